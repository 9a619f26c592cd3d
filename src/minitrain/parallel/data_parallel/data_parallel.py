"""Data parallel: every rank holds the whole model and optimizer; gradients are averaged.

One flat gradient buffer, one optimizer over all of it, three ways to sync:

- NaiveDataParallel: after backward, one blocking all-reduce per parameter
  tensor. The simplest correct thing; nothing overlaps.
- BucketedDataParallel (ours, the default): buckets of at most `bucket_mb`,
  each all-reduced while backward still computes the rest (buckets.py); one
  wait before the optimizer step.
- TorchDataParallel: PyTorch's DistributedDataParallel drives the same model,
  the reference for parity and speed. A communication hook sends its bucket
  all-reduces through our comm layer (sum, then divide by N: the same math as
  its default hook) so they are counted and timed like ours.

`no_sync()` skips the sync for all but the last micro-batch of a step, so
gradient accumulation over k micro-batches all-reduces once.
"""
from __future__ import annotations

import contextlib


import torch
import torch.nn as nn

from ...runtime.comm import Comm, PendingCollective
from ..core.buckets import GradientToReduce, OverlappedAllReduce
from ..core.config import ParallelConfig
from ..core.strategy import FlatStrategy, OptimizerFactory
from ..core.offload import copy_converting_on_device


class ReplicatedStrategy(FlatStrategy):
    """Full optimizer state on every rank. Subclasses implement `_sync()`, which must leave the
    rank-averaged gradient in `to_reduce.tensor()`: flat.grad itself, or its copy in a wider reduce
    dtype (mixed precision with --reduce-dtype fp32)."""

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        self._synced = False
        self.to_reduce = GradientToReduce(self.flat, self.ledger, self.sum_dtype)

    def _sync(self) -> None:
        raise NotImplementedError

    def finish_grad_sync(self) -> None:
        if not self._synced:
            self.flat.grads_in_place()
            self._sync()
            self._synced = True
            self._show_averaged(self.to_reduce.tensor())

    def _averaged_grad(self) -> torch.Tensor:
        self.finish_grad_sync()
        return self.to_reduce.tensor()

    def _publish_target(self) -> torch.Tensor | None:
        return self.flat.data if self.pcfg.offload != "none" and not self.master_is_params else None

    def _publish(self, published: torch.Tensor | None) -> None:
        if published is None and not self.master_is_params:  # else the optimizer has updated the parameters
            # Rounds to the parameters' dtype in mixed precision.
            copy_converting_on_device(self.flat.data, self.optimizer.master)

    def _end_step(self) -> None:
        self._forget_sync()

    def _forget_sync(self) -> None:
        self._synced = False
        self.to_reduce.release()


class NaiveDataParallel(ReplicatedStrategy):
    name = "ddp-naive"

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        self._suspended = False
        self._sync_when_backward_ends(lambda: self._suspended)

    @contextlib.contextmanager
    def no_sync(self):
        """Nothing to suspend in backward unless the sync runs when it ends (user_loop)."""
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    @torch.no_grad()
    def _sync(self) -> None:
        backward_end = self.comm.clock.mark()
        intervals = [self.comm.all_reduce_sum_async(self.to_reduce.range(s.offset, s.offset + s.numel)).wait()
                     for s in self.flat.segments]
        self._average(self.to_reduce.tensor())
        self.sync_at(len(self.flat.segments), intervals, backward_end)


class BucketedDataParallel(ReplicatedStrategy):
    name = "ddp-bucketed"

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        self.overlapped = OverlappedAllReduce(self.flat, comm, self.to_reduce, int(pcfg.bucket_mb * 2**20))
        self.hooks += self.overlapped.handles
        self.buckets = self.overlapped.buckets
        self._sync_when_backward_ends(lambda: not self.overlapped.enabled)

    def no_sync(self):
        return self.overlapped.no_sync()

    @torch.no_grad()
    def _sync(self) -> None:
        backward_end = self.comm.clock.mark()
        intervals = self.overlapped.finish()
        self._average(self.to_reduce.tensor())
        self.sync_at(len(self.buckets), intervals, backward_end)


class TorchDataParallel(ReplicatedStrategy):
    name = "ddp-torch"

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        if comm.group is None:
            raise RuntimeError("PyTorch DDP needs a process group: launch ranks (even one) with the launcher")
        from torch.nn.parallel import DistributedDataParallel

        device = self.flat.data.device
        # gradient_as_bucket_view=False: DDP copies averaged buckets back into .grad in place,
        # so gradients stay views of our flat buffer and the shared optimizer sees them.
        self.module = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, process_group=comm.group,
            bucket_cap_mb=pcfg.bucket_mb, gradient_as_bucket_view=False)
        self.module.register_comm_hook(None, self._all_reduce_mean)
        self._launched: list[PendingCollective] = []

    # No return annotation: DDP checks it by identity, and this module's annotations are strings.
    def _all_reduce_mean(self, _state, bucket):
        buffer = bucket.buffer()
        # DDP's buckets hold the parameters' dtype; a wider reduce dtype sums a copy and rounds back.
        wide = buffer if self.reduce_dtype == buffer.dtype else buffer.to(self.reduce_dtype)
        pending = self.comm.all_reduce_sum_async(wide)
        self._launched.append(pending)
        return pending.then(lambda: buffer.copy_(self._average(wide)))

    def no_sync(self):
        return self.module.no_sync()

    def close(self) -> None:
        """Also let go of the DDP wrapper: its reducer holds the comm hook (this strategy) in C++, where the collector
        cannot see the cycle; with the wrapper gone the reducer and its hooks on the parameters go too."""
        super().close()
        self.module = self.model

    def _sync(self) -> None:
        # DDP finished the all-reduces inside backward; collect their timings.
        intervals = [pending.wait() for pending in self._launched]
        self._launched = []
        self.sync_at(len(intervals), intervals, None)
