"""ZeRO-1 (Rajbhandari et al., SC'20): optimizer state sharded across ranks.

The flat buffers are padded to a multiple of N; rank r owns flat indices
[r*P/N, (r+1)*P/N) and keeps only that slice of the master weights and Adam
m and v: 12*P/N bytes in float32 instead of 12*P. One step:
  1. reduce_scatter the full gradient buffer: rank r receives the sum of its
     slice over all ranks (then divides by N: the averaged gradient);
  2. the global gradient norm: each rank's sum of squares, all-reduced;
  3. Adam on the slice (clipped);
  4. all_gather the updated slices back into every rank's full parameters.
Gradients stay full-size between steps here; sharding them is ZeRO-2.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm
from ..config import TrainConfig
from .flat import FlatStrategy


class Zero1(FlatStrategy):
    name = "zero1"
    shard_optimizer = True

    def __init__(self, model: nn.Module, comm: Comm, cfg: TrainConfig):
        super().__init__(model, comm, cfg)
        self._grad_shard: torch.Tensor | None = None

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Step 1: this rank's slice of the rank-averaged gradient."""
        if self._grad_shard is None:
            self.flat.check_grads_in_place()
            # Transient: released by step(), so not part of at-rest memory.
            shard = torch.empty_like(self.optimizer.master)
            self.comm.reduce_scatter_sum(shard, self.flat.grad)
            self._grad_shard = shard.div_(self.comm.world_size)

    @torch.no_grad()
    def step(self, lr: float) -> float:
        self.finish_grad_sync()
        grad_shard, self._grad_shard = self._grad_shard, None
        sum_sq = grad_shard.double().square().sum().reshape(1)
        self.comm.all_reduce_sum(sum_sq)
        norm, scale = self._clip_scale(sum_sq)
        self.optimizer.step(grad_shard, lr, scale)
        self.comm.all_gather(self.flat.data, self.optimizer.master)
        return norm
