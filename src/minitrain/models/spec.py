"""What the trainer needs of a model family, and nothing more (torchtitan's shape: a model and its parallelize
plan behind one small spec): how to build the model from the run's model settings, and its plan."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..config import ModelConfig
from ..parallel.core.model_plan import ModelPlan


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[ModelConfig], nn.Module]  # a model on the current default device, its weights initialised
    plan: ModelPlan  # its tensor-parallel layers, pipeline split and recomputation targets (parallel/core/model_plan.py)
