"""ZeRO-1: optimizer state sharded; every rank keeps the full gradient and the full parameters.

Its gradient sync is data parallel's bucketed all-reduce, overlapped with backward (core/buckets.py), and each
rank then reads its shard of the sum. An all-reduce moves twice a reduce-scatter's bytes in theory, but it hides
behind backward, which one reduce-scatter of the whole model after backward cannot, and on gloo it is also the
faster op (docs/zero.md). This is how PyTorch's ZeroRedundancyOptimizer is used (under DDP) and DeepSpeed's
stage 1 with overlap_comm. One unit: the whole model.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...runtime.comm import Comm
from ..core.buckets import GradientToReduce, OverlappedAllReduce
from ..core.config import ParallelConfig
from ..core.strategy import OptimizerFactory
from .sharded import ShardedStrategy


class Zero1(ShardedStrategy):
    name = "zero1"
    stage = 1

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        self.to_reduce = GradientToReduce(self.flat, self.ledger, self.sum_dtype)
        self.overlapped = OverlappedAllReduce(self.flat, comm, self.to_reduce, int(pcfg.bucket_mb * 2**20))
        self.hooks += self.overlapped.handles
        self.buckets = self.overlapped.buckets
        self._synced = False
        # A loop that reads p.grad gets every gradient averaged, as at data parallel: the whole summed buffer is
        # divided (not only this rank's shard), when backward ends.
        self._sync_when_backward_ends(lambda: not self.overlapped.enabled)

    def no_sync(self):
        return self.overlapped.no_sync()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        if not self._synced:
            self.flat.grads_in_place()
            backward_end = self.comm.clock.mark()
            intervals = self.overlapped.finish()
            self.sync_at(len(self.buckets), intervals, backward_end)
            self._synced = True
            if self._averaged_in_sync:
                self._show_averaged(self._average(self.to_reduce.tensor()))

    def _gradient_shard(self) -> torch.Tensor:
        """This rank's range of the summed gradient: a view (one unit, the whole model, gives one range)."""
        (start, stop), = self.shard_ranges
        return self.to_reduce.tensor()[start:stop]

    def _forget_sync(self) -> None:
        super()._forget_sync()
        self._synced = False
        self.to_reduce.release()
