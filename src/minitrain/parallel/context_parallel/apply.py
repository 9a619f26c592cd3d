"""Context parallelism applied to a model from outside:
- by its plan (parallel/core/model_plan.py; MiniGPT's): each attention core, method(q, k, v) on
  (B, heads, T, head_dim), is replaced on its instance by ring or Ulysses attention over the group;
- a Hugging Face model (hugging_face.py): its attention is a function it looks up by name in its config, so a
  function doing the same over the group is registered under a name of its own;
- in both, each position module, called with positions 0..T-1 of the tokens it has (MiniGPT's learned position
  embedding, a Llama's rotary embedding), gets the positions of this rank's tokens in the whole sequence instead.
The loop gives the model this rank's tokens (ContextLayout.local: the trainer, or minitrain.context_shard).
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


def attention_over(comm: Comm, style: str, layout: ContextLayout):
    """The attention function of `style` over `comm`: attend(q, k, v) on this rank's (B, heads, T/N, d)."""
    if style not in STYLES:
        raise ValueError(f"context-parallel style must be ring or ulysses, got {style!r}")
    return functools.partial(STYLES[style], comm=comm, layout=layout)


class ReplacedMethod:
    """A method replaced on one module instance; remove() gives the module its own again."""

    def __init__(self, module: nn.Module, name: str, replacement):
        self.module, self.name, self.own = module, name, module.__dict__.get(name)
        setattr(module, name, replacement)

    def remove(self) -> None:
        if self.own is None:
            self.module.__dict__.pop(self.name, None)
        else:
            setattr(self.module, self.name, self.own)


def apply_context_parallel(model: nn.Module, comm: Comm, plan: ModelPlan | None, style: str = "ring") -> list:
    """Change `model` for context parallelism over `comm` by its plan; returns what to remove (hooks, replaced
    methods) when the strategy closes. ValueError naming what is missing when the plan does not say."""
    layout = ContextLayout(comm.rank, comm.world_size)
    attend = attention_over(comm, style, layout)
    cores = plan.attention(model) if plan is not None and plan.attention is not None else []
    if not cores:
        raise ValueError(f"context parallelism needs {type(model).__name__}'s attention cores (its plan's "
                         "`attention`, or cp_plan='auto' for a Hugging Face model): without them attention would "
                         "see only this rank's tokens")
    replaced = [ReplacedMethod(module, name, attend) for module, name in cores]
    return replaced + whole_sequence_positions(plan.positions(model) if plan.positions is not None else [], layout)


def whole_sequence_positions(modules: list[tuple[nn.Module, int]], layout: ContextLayout) -> list:
    """Each (module, argument index): the positions it is called with (0..T-1 of this rank's tokens, a tensor
    positional or the keyword `position_ids`) mapped to their positions in the whole sequence."""
    return [module.register_forward_pre_hook(functools.partial(_map_positions, layout, index), with_kwargs=True)
            for module, index in modules]


def _map_positions(layout: ContextLayout, index: int, _module: nn.Module, args: tuple, kwargs: dict):
    def whole(local: torch.Tensor) -> torch.Tensor:
        return layout.positions(local.size(-1) * layout.ranks, device=local.device)[local]

    if kwargs.get("position_ids") is not None:
        return args, {**kwargs, "position_ids": whole(kwargs["position_ids"])}
    return (*args[:index], whole(args[index]), *args[index + 1:]), kwargs
