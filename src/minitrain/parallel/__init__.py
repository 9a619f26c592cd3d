"""Parallel strategies. `make_strategy` picks one from the config."""
from __future__ import annotations

import torch.nn as nn

from ..comm import Comm
from ..config import RunConfig
from .ddp import BucketedDataParallel, NaiveDataParallel, TorchDataParallel
from .flat import FlatStrategy
from .zero import Zero1, Zero2
from .zero3 import Zero3


def make_strategy(model: nn.Module, comm: Comm, cfg: RunConfig, tp: Comm | None = None) -> FlatStrategy:
    """The data-parallel strategy over `comm` for `model` (which may already be split across `tp`)."""
    strategy = _data_parallel(model, comm, cfg)
    if tp is not None:
        strategy.use_tensor_parallel(tp)
    return strategy


def _data_parallel(model: nn.Module, comm: Comm, cfg: RunConfig) -> FlatStrategy:
    stage = cfg.train.zero
    if stage == 3:
        return Zero3(model, comm, cfg.train, prefetch=cfg.train.prefetch)
    if stage in (1, 2):
        return (Zero1 if stage == 1 else Zero2)(model, comm, cfg.train)
    if cfg.ddp.mode == "naive":
        return NaiveDataParallel(model, comm, cfg.train)
    bucketed = BucketedDataParallel if cfg.ddp.mode == "bucketed" else TorchDataParallel
    return bucketed(model, comm, cfg.train, cfg.ddp.bucket_mb)


__all__ = ["BucketedDataParallel", "NaiveDataParallel", "TorchDataParallel", "FlatStrategy", "Zero1", "Zero2",
           "Zero3", "make_strategy"]
