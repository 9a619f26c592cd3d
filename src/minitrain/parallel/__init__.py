"""Parallel strategies, composed in one place: `parallelize`."""
from __future__ import annotations

import torch.nn as nn

from ..comm import Comm
from ..config import RunConfig
from ..recompute import apply_activation_checkpointing
from ..topology import Topology
from .ddp import BucketedDataParallel, NaiveDataParallel, TorchDataParallel
from .flat import FlatStrategy
from .tensor import apply_tensor_parallel
from .zero import Zero1, Zero2
from .zero3 import Zero3


def parallelize(model: nn.Module, topo: Topology, cfg: RunConfig) -> FlatStrategy:
    """Apply every parallelism the layout asks for to a full, identically initialised MiniGPT, in
    the only order that works (pipeline parallelism is not implemented yet; it would come second,
    dropping the blocks of other stages from the tensor-parallel model):
    1. tensor parallel: it replaces layers by their slices, and everything after must see the
       slices (the data-parallel strategy flattens exactly the parameters this rank holds);
    2. activation checkpointing: it wraps module calls from outside and must wrap the final
       modules, while keeping their hooks, which ZeRO-3 installs next;
    3. data parallel / ZeRO over the data-parallel group: it flattens (and at ZeRO-3 shards) the
       parameters, so it comes last; it is told about the tensor-parallel group so that global
       norms count each sliced parameter's squares across the group and replicated ones once.
    Returns the strategy (its `module` is what forward runs on)."""
    apply_tensor_parallel(model, topo.tp)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    return make_strategy(model, topo.dp, cfg, topo.tp)


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
           "Zero3", "make_strategy", "parallelize"]
