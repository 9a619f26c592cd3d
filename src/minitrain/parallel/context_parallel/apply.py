"""Context parallelism applied to a model from outside, by its plan (parallel/core/model_plan.py):
- each attention core the plan names, method(q, k, v) on (B, heads, T, head_dim), is replaced on its instance by
  ring or Ulysses attention over the group;
- each position module it names, called with positions 0..T-1 of the tokens it has, gets the positions of this
  rank's tokens in the whole sequence instead;
- the model's forward takes whole sequences (B, T, ...), as a loader gives them, and keeps this rank's tokens of
  every tensor argument: its inputs and its targets alike.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ...runtime.comm import Comm
from ..core.model_plan import ModelPlan
from .layout import ContextLayout
from .ring import ring_attend
from .ulysses import ulysses_attend

STYLES = {"ring": ring_attend, "ulysses": ulysses_attend}


def apply_context_parallel(model: nn.Module, comm: Comm, plan: ModelPlan | None, style: str = "ring") -> list:
    """Change `model` for context parallelism over `comm`; returns the hooks' handles (the strategy removes them
    when it closes). ValueError naming what is missing when the model has no plan for it."""
    if style not in STYLES:
        raise ValueError(f"context-parallel style must be ring or ulysses, got {style!r}")
    cores = plan.attention(model) if plan is not None and plan.attention is not None else []
    if not cores:
        raise ValueError(f"context parallelism needs {type(model).__name__}'s attention cores (its plan's "
                         "`attention`): without them the attention would see only this rank's tokens")
    layout = ContextLayout(comm.rank, comm.world_size)
    for module, name in cores:
        setattr(module, name, functools.partial(STYLES[style], comm=comm, layout=layout))
    handles = [model.register_forward_pre_hook(functools.partial(_this_ranks_tokens, layout))]
    for module in plan.positions(model) if plan.positions is not None else []:
        handles.append(module.register_forward_pre_hook(functools.partial(_whole_sequence_positions, layout)))
    return handles


def _this_ranks_tokens(layout: ContextLayout, _model: nn.Module, args: tuple) -> tuple:
    return tuple(layout.local(a) if isinstance(a, torch.Tensor) and a.dim() >= 2 else a for a in args)


def _whole_sequence_positions(layout: ContextLayout, _module: nn.Module, args: tuple) -> tuple:
    local = args[0]
    return (layout.positions(local.size(-1) * layout.ranks, device=local.device)[local], *args[1:])
