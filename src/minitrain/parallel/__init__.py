"""Parallel strategies, composed in one place: `parallelize`."""
from __future__ import annotations

import torch.nn as nn

from ..comm import Comm
from ..config import RunConfig
from ..precision import autocast, compute_dtype
from ..recompute import apply_activation_checkpointing
from ..topology import Topology
from .ddp import BucketedDataParallel, NaiveDataParallel, TorchDataParallel
from .flat import FlatStrategy
from .pipeline import Pipeline, split_into_stage
from .tensor import apply_tensor_parallel
from .zero import Zero1, Zero2
from .zero3 import Zero3


def parallelize(model: nn.Module, topo: Topology, cfg: RunConfig) -> tuple[FlatStrategy, Pipeline | None]:
    """Apply every parallelism the layout asks for to a full, identically initialised MiniGPT, in
    the only order that works:
    1. tensor parallel: it replaces layers by their slices and expects the whole model (the
       embedding and the head it splits over the vocabulary); everything after must see the slices;
    2. pipeline parallel: it deletes the (already sliced) modules other stages run, so that
       nothing after it, above all the data-parallel strategy, holds or syncs their parameters;
    3. activation checkpointing: it wraps module calls from outside and must wrap the final
       modules, while keeping their hooks, which ZeRO-3 installs next;
    4. data parallel / ZeRO over the data-parallel group (the replicas of this very slice): it
       flattens (and at ZeRO-3 shards) the parameters, so it comes last; it is told about the
       tensor- and pipeline-parallel groups so that norms cover the whole model.
    Returns the strategy (its `module` is what forward runs on) and, when the model is pipelined or
    the batch cut into micro-batches, the Pipeline that runs each step's schedule (else None)."""
    apply_tensor_parallel(model, topo.tp)
    split_into_stage(model, topo.pp.rank, topo.pp.world_size)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    strategy = make_strategy(model, topo.dp, cfg, topo.tp, topo.pp)
    d = cfg.dist
    if d.pp == 1 and d.microbatches == 1:
        return strategy, None
    pipeline = Pipeline(strategy.module, topo.pp, d.schedule, d.microbatches, cfg.model.d_model,
                        compute_dtype(cfg.train), topo.device, lambda: autocast(cfg.train, topo.device),
                        strategy.no_sync)
    return strategy, pipeline


def make_strategy(model: nn.Module, comm: Comm, cfg: RunConfig, tp: Comm | None = None,
                  pp: Comm | None = None) -> FlatStrategy:
    """The data-parallel strategy over `comm` for `model` (which may already be split across `tp` and `pp`)."""
    strategy = _data_parallel(model, comm, cfg)
    if tp is not None or pp is not None:
        strategy.use_model_parallel(tp or Comm(), pp or Comm())
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


__all__ = ["BucketedDataParallel", "NaiveDataParallel", "TorchDataParallel", "FlatStrategy", "Pipeline", "Zero1",
           "Zero2", "Zero3", "make_strategy", "parallelize"]
