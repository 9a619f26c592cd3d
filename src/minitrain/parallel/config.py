"""The few settings a data-parallel strategy needs, typed and independent of the CLI's configuration
(the trainer builds one from its TrainConfig, `minitrain.prepare` from its keyword arguments)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

ZERO_STAGES = (0, 1, 2, 3)
DP_MODES = ("bucketed", "naive", "torch")


@dataclass(frozen=True)
class ParallelConfig:
    zero: int = 0  # 0 data parallel, 1-3 the ZeRO stages
    dp: str = "bucketed"  # how ZeRO-0 syncs gradients: bucketed | naive | torch
    bucket_mb: float = 25.0  # gradient bucket cap (bucketed and torch modes)
    prefetch: bool = True  # ZeRO-3: gather the next unit while the current one computes
    master_dtype: torch.dtype = torch.float32  # the optimizer's master weights and state
    reduce_dtype: torch.dtype = torch.float32  # what gradients are summed across ranks in
    grad_clip: float = 0.0  # clip the global gradient norm to this at every step (0: only when asked)
    # Full precision at ZeRO-0/1: the optimizer updates the parameters this rank holds in place, as plain PyTorch
    # does, instead of a master copy holding the same numbers (4 bytes per parameter, or per shard element,
    # saved). The CLI keeps the copy (its memory profile and demo count K = 12 bytes of optimizer state).
    master_is_params: bool = False
    # ZeRO-3 on a model minitrain did not write: gather a unit whose parameter is used outside its own module's
    # forward when an op receives it (param_use.py). The CLI's MiniGPT never does that, and its compiled blocks
    # run without the mode.
    gather_on_use: bool = False
    # A user's loop may read p.grad as DistributedDataParallel's users do (visible_grads.py): averaged when backward
    # returns at ZeRO-0/1, a ShardedGradient that says where the gradient went at ZeRO-2/3. The CLI reads none.
    grads_visible: bool = False

    def __post_init__(self):
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of {ZERO_STAGES}; got {self.zero!r}")
        if self.dp not in DP_MODES:
            raise ValueError(f"dp must be one of {', '.join(DP_MODES)}; got {self.dp!r}")
        if self.zero and self.dp != "bucketed":
            raise ValueError(f"dp={self.dp!r} applies to zero=0; ZeRO-{self.zero} syncs with its own reduce-scatter")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
