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
    # Where the optimizer's master and state live (none | cpu | disk: offload.py, the optimizer's store); offloaded
    # at ZeRO-2/3 the gradient shard, which the optimizer reads on the host, lives in host memory too (as
    # ZeRO-Offload's), each unit's reduce-scatter landing on the device and copied out.
    offload: str = "none"
    # Full precision at ZeRO-0/1: the optimizer updates the parameters this rank holds in place, as plain PyTorch
    # does, instead of a master copy holding the same numbers (4 bytes per parameter, or per shard element,
    # saved). The CLI keeps the copy (its memory profile and demo count K = 12 bytes of optimizer state).
    master_is_params: bool = False
    # The model and the loop are a user's (minitrain.prepare), who may do what users of PyTorch do:
    # - read p.grad as DistributedDataParallel's users do (visible_grads.py): averaged when backward returns at
    #   ZeRO-0/1, a ShardedGradient that says where the gradient went at ZeRO-2/3;
    # - use a parameter outside its own module's forward: ZeRO-3 gathers its unit when an op receives it
    #   (param_use.py);
    # - call model.load_state_dict after prepare (the master is taken from the new values; ZeRO-3 gathers first)
    #   and model.state_dict() (refused at ZeRO-3, whose parameters are shards: full_state_dict gathers them).
    # The CLI's MiniGPT and trainer do none of it, and its compiled blocks run without the ZeRO-3 mode.
    user_loop: bool = False

    def __post_init__(self):
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of {ZERO_STAGES}; got {self.zero!r}")
        if self.dp not in DP_MODES:
            raise ValueError(f"dp must be one of {', '.join(DP_MODES)}; got {self.dp!r}")
        if self.zero and self.dp != "bucketed":
            raise ValueError(f"dp={self.dp!r} applies to zero=0; ZeRO-{self.zero} syncs with its own reduce-scatter")
        if self.offload not in ("none", "cpu", "disk"):
            raise ValueError(f"offload must be none, cpu or disk; got {self.offload!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
