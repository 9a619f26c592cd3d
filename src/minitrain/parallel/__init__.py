"""Parallel strategies. `make_strategy` picks one from the config."""
from __future__ import annotations

import torch.nn as nn

from ..comm import Comm
from ..config import TrainConfig
from .ddp import DataParallel
from .flat import FlatStrategy
from .zero import Zero1

STRATEGIES: dict[int, type[FlatStrategy]] = {0: DataParallel, 1: Zero1}


def make_strategy(model: nn.Module, comm: Comm, cfg: TrainConfig) -> FlatStrategy:
    return STRATEGIES[cfg.zero](model, comm, cfg)


__all__ = ["DataParallel", "FlatStrategy", "Zero1", "make_strategy", "STRATEGIES"]
