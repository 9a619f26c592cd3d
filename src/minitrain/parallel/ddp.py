"""Data parallel, version 1: every rank holds the whole model and optimizer.

Initial parameters are broadcast from rank 0 (in FlatStrategy); after
backward, one all-reduce of the flat gradient buffer sums gradients across
ranks and each rank divides by N, so every replica applies the same averaged
gradient and stays bit-identical. (Bucketed, backward-overlapped sync is the
next step; this is the reference it will be checked against.)
"""
from __future__ import annotations

import torch

from .flat import FlatStrategy


class DataParallel(FlatStrategy):
    name = "ddp"
    shard_optimizer = False

    @torch.no_grad()
    def step(self, lr: float) -> float:
        self.flat.check_grads_in_place()
        grad = self.flat.grad
        self.comm.all_reduce_sum(grad)
        grad.div_(self.comm.world_size)
        norm, scale = self._clip_scale(grad.double().square().sum())
        self.optimizer.step(grad, lr, scale)
        self.flat.data.copy_(self.optimizer.master)
        return norm
