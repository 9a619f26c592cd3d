"""The DDP lab's names: a thin wrapper over stock PyTorch DistributedDataParallel.

    from minitrain.ddp import init_distributed, wrap_for_ddp, is_main_process, barrier, cleanup
    from minitrain.data import make_shard

`wrap_for_ddp(model)` is PyTorch's DDP with its default buckets on minitrain's process group; the others are the
library's own functions (the same objects as `minitrain.is_main_process` and the rest), except that the lab's
`init_distributed` joins with gloo unless told otherwise. See experiments/35-ddp-cpu/train.py for the lab's loop.
"""
from __future__ import annotations

from .api import barrier, cleanup, is_main_process, wrap_for_ddp
from .api import init_distributed as _join


def init_distributed(backend: str = "gloo", timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group torchrun describes (gloo by default, as the lab runs on the CPU), or run as rank 0
    of 1 without one. Returns (rank, world size)."""
    return _join(backend, timeout_s)


__all__ = ["barrier", "cleanup", "init_distributed", "is_main_process", "wrap_for_ddp"]
