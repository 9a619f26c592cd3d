"""How big a model config's model is, without building it for real: the parameters of each unit ZeRO-2/3 move
together, from a build on the meta device (no memory, no initialisation cost). The planner sizes a run's memory
with them, and a run sizes what it offloads, or shards over parameter servers, before its model exists."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..parallel.core.units import module_units
from ..parallel.expert_parallel.experts import shard_experts
from ..runtime.comm import Comm
from . import spec_for


def model_units(cfg: ModelConfig, ep: int = 1) -> dict[str, int]:
    """Parameter count of each unit ZeRO-2/3 move together (parallel/core/units.py), in layout order; with ep > 1
    the units one expert-parallel rank holds (its 1/ep of each layer's experts: parallel/expert_parallel/)."""
    with torch.device("meta"):
        model = spec_for(cfg).build(cfg)
        if ep > 1:
            shard_experts(model, Comm(0, ep))  # rank 0's share: every rank's is the same size
    named = dict(model.named_parameters())
    return {plan.name: sum(named[n].numel() for n in plan.params) for plan in module_units(model)}


def model_params(cfg: ModelConfig) -> int:
    return sum(model_units(cfg).values())
