"""Data parallel: every rank holds the whole model and optimizer; gradients are averaged.

One flat gradient buffer, one optimizer over all of it, three ways to sync:

- NaiveDataParallel: after backward, one blocking all-reduce per parameter
  tensor. The simplest correct thing; nothing overlaps.
- BucketedDataParallel (ours, the default): the flat gradient buffer is cut
  into buckets of at most `bucket_mb`, in reverse registration order (the order
  backward produces gradients). A post-accumulate-grad hook on every parameter
  counts arrivals; when a bucket's last gradient lands, its async all-reduce
  starts at once and runs while backward computes the rest. Gradients are
  views into the buckets, so nothing is copied in or out. One wait before
  the optimizer step. Buckets launch strictly in bucket order, so every rank
  issues the same collectives in the same order even if hooks fire slightly
  out of order (a mismatched order is the classic data-parallel hang).
- TorchDataParallel: PyTorch's DistributedDataParallel drives the same model,
  the reference for parity and speed. A communication hook sends its bucket
  all-reduces through our comm layer (sum, then divide by N: the same math as
  its default hook) so they are counted and timed like ours.

`no_sync()` skips the sync for all but the last micro-batch of a step, so
gradient accumulation over k micro-batches all-reduces once.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..comm import Comm, PendingCollective
from .config import ParallelConfig
from .flat import FlatStrategy, OptimizerFactory, sync_summary
from .layout import Segment


class ReplicatedStrategy(FlatStrategy):
    """Full optimizer state on every rank. Subclasses implement `_sync()`, which must leave the
    rank-averaged gradient in `_reduced()`: flat.grad itself, or its copy in a wider reduce
    dtype (mixed precision with --reduce-dtype fp32)."""

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        self._synced = False
        self._wide: torch.Tensor | None = None  # this step's gradient in the reduce dtype, when that differs

    def _sync(self) -> None:
        raise NotImplementedError

    def _to_reduce(self, start: int, stop: int) -> torch.Tensor:
        """The gradient range [start, stop) to sum across ranks: a view of flat.grad, or its copy
        into a zeroed reduce-dtype buffer the size of the model, held until the update."""
        grad = self.flat.grad
        if self.reduce_dtype == grad.dtype:
            return grad[start:stop]
        if self._wide is None:
            self._wide = torch.zeros(grad.numel(), dtype=self.reduce_dtype, device=grad.device)
            self.ledger.hold("grads", self._wide)
        return self._wide[start:stop].copy_(grad[start:stop])

    def _reduced(self) -> torch.Tensor:
        return self.flat.grad if self._wide is None else self._wide

    def finish_grad_sync(self) -> None:
        if not self._synced:
            self.flat.check_grads_in_place()
            self._sync()
            self._synced = True

    def _averaged_grad(self) -> torch.Tensor:
        self.finish_grad_sync()
        return self._reduced()

    def _publish(self) -> None:
        if not self.master_is_params:  # else the optimizer has updated the parameters themselves
            self.flat.data.copy_(self.optimizer.master)  # rounds to the parameters' dtype in mixed precision

    def _end_step(self) -> None:
        self._synced = False
        if self._wide is not None:
            self.ledger.drop("grads", self._wide)
            self._wide = None


class NaiveDataParallel(ReplicatedStrategy):
    name = "ddp-naive"

    @torch.no_grad()
    def _sync(self) -> None:
        backward_end = time.perf_counter()
        intervals = [self.comm.all_reduce_sum_async(self._to_reduce(s.offset, s.offset + s.numel)).wait()
                     for s in self.flat.segments]
        self._reduced().div_(self.comm.world_size)
        self.last_sync = {"buckets": len(self.flat.segments), **sync_summary(intervals, backward_end)}


@dataclass
class Bucket:
    """A contiguous range [start, stop) of the flat gradient buffer holding whole tensors."""

    start: int
    stop: int
    names: list[str] = field(default_factory=list)


def plan_buckets(segments: list[Segment], cap_bytes: int, element_size: int) -> list[Bucket]:
    """Group tensors in reverse registration order into buckets of at most cap_bytes
    (a tensor larger than the cap gets a bucket of its own)."""
    buckets: list[Bucket] = []
    for seg in reversed(segments):
        seg_bytes = seg.numel * element_size
        current = buckets[-1] if buckets else None
        if current is None or (current.stop - current.start) * element_size + seg_bytes > cap_bytes:
            buckets.append(Bucket(seg.offset, seg.offset + seg.numel, [seg.name]))
        else:  # segments are contiguous, so walking backwards extends the range downwards
            current.start = seg.offset
            current.names.append(seg.name)
    return buckets


class BucketedDataParallel(ReplicatedStrategy):
    name = "ddp-bucketed"

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        self.buckets = plan_buckets(self.flat.segments, int(pcfg.bucket_mb * 2**20), self.flat.grad.element_size())
        bucket_of = {name: i for i, b in enumerate(self.buckets) for name in b.names}
        for name in self.flat.names():
            self.flat.param_named(name).register_post_accumulate_grad_hook(
                lambda _p, name=name, i=bucket_of[name]: self._grad_ready(i, name))
        self.require_backward_grad_sync = True
        self._reset()

    def _reset(self) -> None:
        self._arrived: list[set[str]] = [set() for _ in self.buckets]
        self._pending: list[PendingCollective] = []  # launched buckets, in bucket order

    def _grad_ready(self, i: int, name: str) -> None:
        if not self.require_backward_grad_sync:
            return
        if i < len(self._pending):
            raise RuntimeError(f"gradient of '{name}' arrived after its bucket's all-reduce started: run all but "
                               "the last micro-batch of a step under strategy.no_sync()")
        self._arrived[i].add(name)
        # Launch every bucket that is complete, strictly in order (same collective order on every rank).
        while len(self._pending) < len(self.buckets) and \
                len(self._arrived[len(self._pending)]) == len(self.buckets[len(self._pending)].names):
            b = self.buckets[len(self._pending)]
            self._pending.append(self.comm.all_reduce_sum_async(self._to_reduce(b.start, b.stop)))

    @contextlib.contextmanager
    def no_sync(self):
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @torch.no_grad()
    def _sync(self) -> None:
        backward_end = time.perf_counter()
        if len(self._pending) < len(self.buckets):
            arrived = set().union(*self._arrived)
            missing = [s.name for s in self.flat.segments if s.name not in arrived]
            for pending in self._pending:  # finish what was launched: every rank launched the same
                pending.wait()
            self._reset()
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise RuntimeError(f"no gradient reached {shown} this step; bucketed data parallel needs every "
                               "parameter to take part in the loss (remove unused ones from the model)")
        intervals = [pending.wait() for pending in self._pending]
        self._reset()
        self._reduced().div_(self.comm.world_size)
        self.last_sync = {"buckets": len(self.buckets), **sync_summary(intervals, backward_end)}


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
        return pending.then(lambda: buffer.copy_(wide.div_(self.comm.world_size)))

    def no_sync(self):
        return self.module.no_sync()

    def _sync(self) -> None:
        # DDP finished the all-reduces inside backward; collect their timings.
        intervals = [pending.wait() for pending in self._launched]
        self._launched = []
        self.last_sync = {"buckets": len(intervals), **sync_summary(intervals, None)}
