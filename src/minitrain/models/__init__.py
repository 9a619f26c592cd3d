"""Models minitrain ships, each a spec (spec.py) of the model and its parallelism plan: MiniGPT."""
from __future__ import annotations

from ..config import ModelConfig
from .minigpt import MINIGPT
from .spec import ModelSpec


def spec_for(cfg: ModelConfig) -> ModelSpec:
    """The model family a run's model settings describe (MiniGPT is the one today)."""
    return MINIGPT


__all__ = ["ModelSpec", "spec_for"]
