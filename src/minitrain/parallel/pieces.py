"""Pipeline stages of a model minitrain did not write, cut from an ordered list of its pieces.

MiniGPT's forward runs whichever parts a stage kept (minigpt_plan.py). A Hugging Face model's does
not, so a stage here runs the pieces itself, in the order the split lists them:

    PipelineSplit(["model.embed_tokens", "model.layers", "model.norm", "lm_head"])

Exactly one piece is the blocks container (a ModuleList or ModuleDict): its blocks are balanced over
the stages (`stage_blocks`, the first stages taking one more); the pieces before it run on the first
stage, those after it on the last. What a stage does not run is deleted from the model, so that the
data-parallel strategy after it neither holds nor syncs it; the kept blocks stay under their own
names (the container becomes a ModuleDict keyed by the original indices), so a checkpoint of any
layout names every parameter as the whole model does.

`block_kwargs(model, hidden)` gives what each block needs besides the hidden states: for a
Hugging Face Llama the rotary position embeddings, computed by the base model's `rotary_emb` (which
holds no parameters and stays on every stage). With no attention mask passed, the model's SDPA
attention is causal. `PipelineSplit.auto(model)` reads a Hugging Face model's own `base_model_pp_plan`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .pipeline import stage_blocks

BlockKwargs = Callable[[nn.Module, torch.Tensor], dict]


@dataclass(frozen=True)
class PipelineSplit:
    pieces: list[str]
    block_kwargs: BlockKwargs | None = None

    @classmethod
    def auto(cls, model: nn.Module) -> PipelineSplit:
        """A Hugging Face model's own split: its config's `base_model_pp_plan` (embedding, layers, norm) under the
        base model, then the head; rotary position embeddings for the blocks if the base model has them."""
        base_plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
        prefix = getattr(model, "base_model_prefix", "")
        if not base_plan or not hasattr(model, prefix):
            raise ValueError(f"pp_split='auto' reads a Hugging Face model's own pipeline plan, and "
                             f"{type(model).__name__} ships none (config.base_model_pp_plan); give pp_split as the "
                             "ordered names of its pieces")
        pieces = [f"{prefix}.{name}" for name in base_plan] + list(getattr(type(model), "_pp_plan", None) or {})
        base = getattr(model, prefix)
        return cls(pieces, _rotary_kwargs if hasattr(base, "rotary_emb") else None)


def _rotary_kwargs(model: nn.Module, hidden: torch.Tensor) -> dict:
    base = getattr(model, model.base_model_prefix)
    positions = torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0)
    return {"position_embeddings": base.rotary_emb(hidden, positions)}


def _lookup(model: nn.Module, name: str) -> nn.Module | None:
    module = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def check_split(model: nn.Module, split: PipelineSplit, stages: int) -> int:
    """The blocks container's index in the pieces; ValueError naming what is wrong."""
    missing = [name for name in split.pieces if not isinstance(_lookup(model, name), nn.Module)]
    if missing:
        raise ValueError(f"pp_split names {missing[0]!r}, which is not a module of {type(model).__name__}")
    containers = [i for i, name in enumerate(split.pieces)
                  if isinstance(_lookup(model, name), (nn.ModuleList, nn.ModuleDict))]
    if len(containers) != 1:
        raise ValueError(f"pp_split needs exactly one piece that is the blocks container (a ModuleList or "
                         f"ModuleDict); {len(containers)} of {split.pieces} are")
    blocks = len(_lookup(model, split.pieces[containers[0]]))
    if blocks < stages:
        raise ValueError(f"pp={stages} needs at least one block per stage; {split.pieces[containers[0]]} has {blocks}")
    covered = {id(p) for name in split.pieces for p in _lookup(model, name).parameters()}
    loose = [name for name, p in model.named_parameters() if id(p) not in covered]
    if loose:
        raise ValueError(f"parameter {loose[0]!r} is in no piece of pp_split {split.pieces}: name the module it "
                         "belongs to, in forward order")
    return containers[0]


def split_model(model: nn.Module, split: PipelineSplit, stage: int, stages: int) -> None:
    """Keep stage `stage` of `stages` in `model`, in place (the shape ModelPlan.pipeline_split has)."""
    at = check_split(model, split, stages)
    first, last = stage == 0, stage == stages - 1
    container_name = split.pieces[at]
    container = _lookup(model, container_name)
    keep = stage_blocks(len(container), stages)[stage]
    kept = nn.ModuleDict({key: block for i, (key, block) in enumerate(_items(container)) if i in keep})
    for i, name in enumerate(split.pieces):
        parent_name, _, child = name.rpartition(".")
        parent = _lookup(model, parent_name) if parent_name else model
        if i == at:
            setattr(parent, child, kept)
        elif (i < at and not first) or (i > at and not last):
            setattr(parent, child, None)


def _items(container: nn.Module) -> list[tuple[str, nn.Module]]:
    return list(container.items()) if isinstance(container, nn.ModuleDict) else \
        [(str(i), block) for i, block in enumerate(container)]


def cross_stage_ties(model: nn.Module, split: PipelineSplit, stages: int) -> list[str]:
    """Parameters shared by pieces that land on different stages (a tied embedding and head), as 'a and b'
    (call on the whole model). Their two gradients would live on different ranks: refused by the caller
    rather than all-reduced over an embedding group as Megatron does."""
    at = check_split(model, split, stages)
    if stages == 1:
        return []
    owner: dict[int, tuple[str, str]] = {}
    shared = []
    for i, name in enumerate(split.pieces):
        where = "first" if i < at else "last" if i > at else "blocks"
        for pname, p in _lookup(model, name).named_parameters():
            if id(p) in owner and owner[id(p)][0] != where:
                shared.append(f"{owner[id(p)][1]} and {name}.{pname}")
            owner.setdefault(id(p), (where, f"{name}.{pname}"))
    return shared


class Stage:
    """What this rank's stage runs: its pieces in order, and the loss on the last."""

    def __init__(self, model: nn.Module, split: PipelineSplit, stage: int, stages: int):
        self.model, self.split = model, split
        self.first, self.last = stage == 0, stage == stages - 1
        self.parts = [(name, module) for name in split.pieces
                      if isinstance(module := _lookup(model, name), nn.Module)]
        self.blocks_at = next(i for i, (_, m) in enumerate(self.parts) if isinstance(m, nn.ModuleDict))

    def forward(self, x: torch.Tensor, target: torch.Tensor | None, loss_fn: Callable) -> torch.Tensor:
        for i, (_, module) in enumerate(self.parts):
            if i != self.blocks_at:
                x = module(x)
                continue
            kwargs = self.split.block_kwargs(self.model, x) if self.split.block_kwargs else {}
            for block in module.values():
                out = block(x, **kwargs)
                x = out[0] if isinstance(out, tuple) else out  # older transformers return (hidden, ...)
        return loss_fn(x, target) if self.last and target is not None else x

    @torch.no_grad()
    def activation_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The shape stages exchange, from a real forward of the first stage's pieces before its blocks
        (the blocks keep it): only meaningful on the first stage."""
        for _, module in self.parts[:self.blocks_at]:
            x = module(x)
        return tuple(x.shape)
