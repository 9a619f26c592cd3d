"""Pipeline stages of a model minitrain did not write, cut from an ordered list of its pieces.

MiniGPT's forward runs whichever parts a stage kept (models/minigpt/plan.py). A Hugging Face model's does
not, so a stage here runs the pieces itself, in the order the split lists them:

    PipelineSplit(["model.embed_tokens", "model.layers", "model.norm", "lm_head"])

Exactly one piece is the blocks container (a ModuleList or ModuleDict): its blocks are balanced over
the stages (`stage_blocks`, the first stages taking one more); the pieces before it run on the first
stage, those after it on the last. What a stage does not run is deleted from the model, so that the
data-parallel strategy after it neither holds nor syncs it; the kept blocks stay under their own
names (the container becomes a ModuleDict keyed by the original indices), so a checkpoint of any
layout names every parameter as the whole model does.

`block_kwargs(model, hidden)` gives what each block needs besides the hidden states: for a
Hugging Face model (`PipelineSplit.auto(model)`, from its own `base_model_pp_plan`) the rotary position
embeddings, computed by the base model's `rotary_emb` (which holds no parameters and stays on every
stage), and the causal attention mask its own masking function makes (None for SDPA, which is then
causal by itself; a real mask for eager attention, which would otherwise look at later tokens).

Running pieces is exact only if the model's forward does nothing else: `check_pieces` runs both, the
model's own forward and its pieces in order, on a probe input before anything is split, and refuses a
split whose output differs (a mask the blocks need and the split does not carry, embeddings scaled in
the base model's forward, logits post-processed after the head), and a Hugging Face config that
soft-caps the logits or slides an attention window, which a short probe cannot tell apart.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .executor import chunk_blocks

BlockKwargs = Callable[[nn.Module, torch.Tensor], dict]


@dataclass(frozen=True)
class PipelineSplit:
    pieces: list[str]
    block_kwargs: BlockKwargs | None = None

    example: torch.Tensor | None = None  # a probe input for check_pieces (default: token ids, for an embedding)

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
        _refuse_what_a_probe_misses(model)
        pieces = [f"{prefix}.{name}" for name in base_plan] + list(getattr(type(model), "_pp_plan", None) or {})
        return cls(pieces, _hugging_face_kwargs)


def _refuse_what_a_probe_misses(model: nn.Module) -> None:
    """A Hugging Face config whose forward does what the pieces would drop, and a short probe cannot show."""
    config = model.config
    name = type(model).__name__
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise ValueError(f"{name} soft-caps its logits after the head (config.final_logit_softcapping), which running "
                         "its pieces would skip: pipeline it with a split of your own that caps them, or use data "
                         "parallel / ZeRO")
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if sliding or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(f"{name} attends within a sliding window (config.sliding_window), and pp_split='auto' carries "
                         "a full causal mask: give a PipelineSplit whose block_kwargs makes the window's mask")


def _hugging_face_kwargs(model: nn.Module, hidden: torch.Tensor) -> dict:
    """What a Hugging Face decoder block takes besides the hidden states: the causal mask the model's own masking
    function makes for these positions, and the rotary position embeddings if the base model has them."""
    base = getattr(model, model.base_model_prefix)
    positions = torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0)
    kwargs = {"attention_mask": _causal_mask(base.config, hidden, positions)}
    if hasattr(base, "rotary_emb"):
        kwargs["position_embeddings"] = base.rotary_emb(hidden, positions)
    return kwargs


def _causal_mask(config, hidden: torch.Tensor, positions: torch.Tensor):
    """transformers' own causal mask (None where the attention is causal without one), across the versions that
    named its arguments differently."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    kwargs = {"config": config, "attention_mask": None, "position_ids": positions,
              ("inputs_embeds" if "inputs_embeds" in params else "input_embeds"): hidden}
    for name in ("cache", "past_key_values"):
        if name in params:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = positions[0]
    return create_causal_mask(**kwargs)


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


def split_model(model: nn.Module, split: PipelineSplit, stage: int, stages: int, virtual: int = 1) -> None:
    """Keep stage `stage` of `stages` in `model`, in place (the shape ModelPlan.pipeline_split has): its chunks'
    blocks, the pieces before them on the first stage, those after them on the last."""
    at = check_split(model, split, stages * virtual)
    first, last = stage == 0, stage == stages - 1
    container_name = split.pieces[at]
    container = _lookup(model, container_name)
    keep = {i for chunk in chunk_blocks(len(container), stage, stages, virtual) for i in chunk}
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


def run_pieces(model: nn.Module, split: PipelineSplit, parts: list[tuple[str, nn.Module]], blocks_at: int,
               x: torch.Tensor, keys: set[str] | None = None) -> torch.Tensor:
    """Run `parts` (name, module) in order on x; the blocks container's blocks (those named in `keys`, default
    all) with split.block_kwargs."""
    for i, (_, module) in enumerate(parts):
        if i != blocks_at:
            x = module(x)
            continue
        kwargs = split.block_kwargs(model, x) if split.block_kwargs else {}
        for key, block in _items(module):
            if keys is not None and key not in keys:
                continue
            out = block(x, **kwargs)
            x = out[0] if isinstance(out, tuple) else out  # older transformers return (hidden, ...)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"pp_split: block '{key}' returned a {type(out).__name__}; pipeline stages pass one "
                                 "tensor (or a tuple starting with it) from block to block")
    return x


def check_pieces(model: nn.Module, split: PipelineSplit, blocks_at: int) -> None:
    """Refuse a split of the whole `model` whose pieces, run in order, do not give what its own forward gives on a
    probe input (eval mode, no gradient; the model is left as it was)."""
    parts = [(name, _lookup(model, name)) for name in split.pieces]
    probe = split.example if split.example is not None else _probe_ids(model, parts[0])
    modes = [(m, m.training) for m in model.modules()]
    buffers = {key: b.clone() for key, b in model.named_buffers()}
    model.eval()
    try:
        with torch.no_grad():
            theirs = _main_output(model(probe))
            after_model = {key: b.clone() for key, b in model.named_buffers()}
            _restore(model, buffers)
            try:
                ours = run_pieces(model, split, parts, blocks_at, probe)
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever breaks, the split does not run this model
                raise ValueError(f"pp_split: running the pieces {split.pieces} in order failed on a probe input "
                                 f"({type(e).__name__}: {e}); list the pieces its forward runs, in order") from e
            after_pieces = dict(model.named_buffers())
            changed = next((key for key in buffers if not torch.equal(after_model[key], after_pieces[key])), None)
    finally:
        for m, training in modes:
            m.training = training
        _restore(model, buffers)
    name = type(model).__name__
    if changed is not None:
        raise ValueError(f"pp_split: {name}.forward updates buffer '{changed}' differently from its pieces run in "
                         "order (an update outside them would never happen): update it inside a piece, or use data "
                         "parallel / ZeRO")
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
        raise ValueError(f"pp_split: the pieces {split.pieces} give a {list(ours.shape)} output where "
                         f"{name}.forward gives {_described(theirs)}: list the pieces its forward runs, in order")
    eps = torch.finfo(ours.dtype).eps if ours.is_floating_point() else 0.0
    scale = max(1.0, float(theirs.abs().max()))
    diff = float((ours - theirs).abs().max())
    if not diff <= 64 * eps * scale:
        raise ValueError(f"pp_split: running the pieces {split.pieces} in order does not give what {name}.forward "
                         f"gives (they differ by up to {diff:.2e} on a probe input): its forward does more than its "
                         "pieces (an attention mask its blocks need, embeddings scaled, logits post-processed). Give "
                         "a PipelineSplit whose block_kwargs carries what the blocks need, or use data parallel / ZeRO")


def _restore(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, b in model.named_buffers():
            b.copy_(buffers[key])


def _probe_ids(model: nn.Module, first: tuple[str, nn.Module]) -> torch.Tensor:
    """Two rows of token ids (ascending and descending) for a model whose first piece is an embedding."""
    name, module = first
    if not isinstance(module, nn.Embedding):
        raise ValueError(f"pp_split: cannot make a probe input for '{name}' (a {type(module).__name__}, not an "
                         "nn.Embedding) to check the pieces against the model's forward; give PipelineSplit(..., "
                         "example=<an input the model takes>)")
    config = getattr(model, "config", None)
    length = min(8, getattr(config, "max_position_embeddings", 8) or 8)
    ids = torch.arange(length) * 7 % module.num_embeddings
    return torch.stack([ids, ids.flip(0)]).to(module.weight.device)


def _main_output(out):
    """The tensor a model's forward returns: itself, a ModelOutput's logits, or the first of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict) and out:
        return next(iter(out.values()))
    if isinstance(out, (tuple, list)) and out:
        return out[0]
    return out


def _described(value) -> str:
    return f"a {list(value.shape)} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


class Chunk(NamedTuple):
    """One of a stage's chunks (one per stage but under the interleaved schedule)."""
    blocks: set[str]  # the keys of its blocks in the stage's container
    first: bool  # the first chunk of the first stage: it runs the pieces before the blocks
    last: bool  # the last chunk of the last stage: the pieces after them, and the loss


class Stage:
    """What this rank's stage runs: its pieces in order, and the loss on the last; under the interleaved schedule
    its `virtual` chunks, the first chunk of the first stage running the pieces before the blocks, the last chunk
    of the last stage those after them and the loss."""

    def __init__(self, model: nn.Module, split: PipelineSplit, stage: int, stages: int, virtual: int = 1):
        self.model, self.split = model, split
        self.parts = [(name, module) for name in split.pieces
                      if isinstance(module := _lookup(model, name), nn.Module)]
        self.blocks_at = next(i for i, (_, m) in enumerate(self.parts) if isinstance(m, nn.ModuleDict))
        keys = list(self.parts[self.blocks_at][1].keys())  # the kept blocks, in order, under their own names
        per = len(keys) // virtual  # interleaved chunks are equal (prepare checks)
        self.chunks = [Chunk(set(keys[c * per:(c + 1) * per]), stage == 0 and c == 0,
                             stage == stages - 1 and c == virtual - 1) for c in range(virtual)]

    def forward(self, x: torch.Tensor, target: torch.Tensor | None, loss_fn: Callable,
                chunk: int = 0) -> torch.Tensor:
        this = self.chunks[chunk]
        before = self.parts[:self.blocks_at] if this.first else []
        after = self.parts[self.blocks_at + 1:] if this.last else []
        parts = [*before, self.parts[self.blocks_at], *after]
        x = run_pieces(self.model, self.split, parts, len(before), x, this.blocks)
        return loss_fn(x, target) if this.last and target is not None else x

    def forwards(self, loss_fn: Callable) -> list[Callable]:
        """Each chunk's forward(input, target or None), in chunk order, as the executor runs them."""
        return [functools.partial(self.forward, loss_fn=loss_fn, chunk=c) for c in range(len(self.chunks))]

    @torch.no_grad()
    def activation_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The shape stages exchange, from a real forward of the first stage's pieces before its blocks
        (the blocks keep it): only meaningful on the first stage."""
        for _, module in self.parts[:self.blocks_at]:
            x = module(x)
        return tuple(x.shape)
