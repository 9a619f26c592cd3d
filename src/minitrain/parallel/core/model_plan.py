"""A model's plan: what the generic parallelisms need to know of one model and cannot guess.

The strategies (data parallel, ZeRO) work on any nn.Module. Splitting a model's layers does
not: which linear layers are column- or row-parallel, where the pipeline may cut, what is cheap
to recompute are facts about one architecture. A plan holds them as plain functions, so a model
file stays free of parallelism (torchtitan's split between `parallelize_llama` and the model).
MiniGPT's plan is models/minigpt/plan.py; a user's model brings its own, or runs without one (data
parallel, ZeRO and block recomputation need none).
"""
from __future__ import annotations

import fnmatch

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelPlan:
    # Which modules become which tensor-parallel layers: {module-name pattern: style} (parallel/tensor_parallel/plans.py).
    tensor_parallel: dict | None = None
    # Keep only stage s of P (in place); the model's forward must then run the parts it still has.
    pipeline_split: Callable[[nn.Module, int, int], None] | None = None
    # The interleaved schedule's split: keep stage s's V chunks of P x V (in place) and return each chunk's
    # forward(x, targets or None), in chunk order.
    pipeline_chunks: Callable[[nn.Module, int, int, int], list[Callable]] | None = None
    # The transformer blocks `block` activation checkpointing recomputes (None: the containers' elements).
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None
    # (module, method name) pairs `selective` activation checkpointing recomputes.
    selective: Callable[[nn.Module], list[tuple[nn.Module, str]]] | None = None
    # Context parallelism: the causal attention cores, (module, method name) pairs called as method(q, k, v) on
    # (B, heads, T, head_dim), and the modules called with the positions 0..T-1 of the tokens they embed, with the
    # index of that argument: (module, index) pairs.
    attention: Callable[[nn.Module], list[tuple[nn.Module, str]]] | None = None
    positions: Callable[[nn.Module], list[tuple[nn.Module, int]]] | None = None


def matches(pattern: str, name: str) -> bool:
    """Segment by segment: `layers.*.mlp` matches `layers.3.mlp` and nothing deeper or shallower."""
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(fnmatch.fnmatchcase(s, p) for s, p in zip(segments, parts))
