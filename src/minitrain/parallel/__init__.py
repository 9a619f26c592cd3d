"""Parallel strategies. `make_strategy` picks one from the config."""
from __future__ import annotations

import torch.nn as nn

from ..comm import Comm
from ..config import RunConfig
from .ddp import BucketedDataParallel, NaiveDataParallel, TorchDataParallel
from .flat import FlatStrategy
from .zero import Zero1

def make_strategy(model: nn.Module, comm: Comm, cfg: RunConfig) -> FlatStrategy:
    if cfg.train.zero == 1:
        return Zero1(model, comm, cfg.train)
    if cfg.ddp.mode == "naive":
        return NaiveDataParallel(model, comm, cfg.train)
    bucketed = BucketedDataParallel if cfg.ddp.mode == "bucketed" else TorchDataParallel
    return bucketed(model, comm, cfg.train, cfg.ddp.bucket_mb)


__all__ = ["BucketedDataParallel", "NaiveDataParallel", "TorchDataParallel", "FlatStrategy", "Zero1",
           "make_strategy"]
