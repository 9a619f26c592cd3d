"""What the trainer needs of a model family, and nothing more (torchtitan's shape: a model and its parallelize
plan behind one small spec): how to build the model from the run's model settings, its plan, and where its
mixture-of-experts layers count their load (a dense family has none)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from ..config import ModelConfig
from ..parallel.core.model_plan import ModelPlan
from ..parallel.expert_parallel.load import ExpertLoad


class CountsExpertLoad(Protocol):
    """A layer that routes tokens to experts and counts where they went: what the trainer logs of it each step."""

    experts: int  # how many experts it routes to

    def take_load(self) -> ExpertLoad:
        """What it counted since the last call; the counts start over."""


def no_expert_layers(model: nn.Module) -> list[CountsExpertLoad]:
    """A dense family's: no layer counts an expert load."""
    return []


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[ModelConfig], nn.Module]  # a model on the current default device, its weights initialised
    plan: ModelPlan  # its tensor-parallel layers, pipeline split and recomputation targets (parallel/core/model_plan.py)
    # The built model's mixture-of-experts layers, in a fixed order (the same on every rank of a run): each step's
    # record sums their load over the ranks (StepRecord.expert_load).
    expert_layers: Callable[[nn.Module], list[CountsExpertLoad]] = no_expert_layers
