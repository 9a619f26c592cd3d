"""Which parameters ZeRO-2 and ZeRO-3 move together: one unit per block, for any model.

A unit is reduce-scattered as one gradient bucket (ZeRO-2 and 3) and gathered
as one parameter buffer just before it computes (ZeRO-3). Coarser units mean
fewer, larger collectives; finer ones a smaller gathered working set (FSDP's
trade-off, where torchtitan also wraps each block).

The rule needs no knowledge of the model: every element of a container
(ModuleList, ModuleDict) anywhere in the tree is a unit (the repeated
transformer blocks: MiniGPT's `blocks.3`, Hugging Face's `model.layers.3` or
`transformer.h.3`); every other submodule that holds trainable parameters and
contains no such container is a unit too (embeddings, final norm, head). For
MiniGPT that is tok_emb, pos_emb, each block, ln_f and head, in the order
forward calls them.

A parameter used by more than one unit (tied embedding and head weights) or
registered on a module that also contains units (the model itself, or a
wrapper) belongs to none of them: it goes into a first unit, "shared", with
no module, which ZeRO-3 gathers when forward starts and frees once its
gradient has been reduced. Frozen parameters (requires_grad=False) are not
flattened at all: they belong to no unit.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass
class UnitPlan:
    name: str
    module: nn.Module | None  # None for the "shared" unit
    params: list[str]  # canonical names (as in model.named_parameters())


def trainable_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its canonical name, for the parameters the strategies flatten (tied weights once)."""
    return {id(p): name for name, p in model.named_parameters() if p.requires_grad}


def _has_container(module: nn.Module) -> bool:
    return any(isinstance(m, CONTAINERS) for m in module.modules())


def _candidates(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """The unit-sized submodules under `module`, in registration order (see the module docstring)."""
    out = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, CONTAINERS):
            for key, element in child.named_children():
                out.append((f"{path}.{key}", element))
        elif _has_container(child):
            out += _candidates(child, f"{path}.")
        elif any(True for _ in child.parameters()):
            out.append((path, child))
    return out


def module_units(model: nn.Module) -> list[UnitPlan]:
    canonical = trainable_names(model)
    candidates = _candidates(model, "")
    owners: dict[int, list[str]] = defaultdict(list)
    for unit_name, module in candidates:
        for p in module.parameters():
            owners[id(p)].append(unit_name)
    shared = [name for pid, name in canonical.items() if len(owners[pid]) != 1]
    plans = [UnitPlan("shared", None, shared)] if shared else []
    for unit_name, module in candidates:
        names = [canonical[id(p)] for p in module.parameters() if id(p) in canonical and len(owners[id(p)]) == 1]
        if names:
            plans.append(UnitPlan(unit_name, module, names))
    return plans


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of the outermost containers in the model (its transformer blocks, not what may be
    nested inside them): what `block` activation checkpointing recomputes when the model brings no plan."""
    blocks = []
    for child in model.children():
        blocks += list(child.children()) if isinstance(child, CONTAINERS) else repeated_blocks(child)
    return blocks


def unit_layout(plans: list[UnitPlan]) -> list[tuple[str, list[str]]]:
    """The (name, parameter names) list FlatParameters lays out."""
    return [(plan.name, plan.params) for plan in plans]


def tensors_in(value, depth: int = 6) -> Iterator[torch.Tensor]:
    """Every tensor in `value`, however it is held: lists, tuples, dicts (a Hugging Face ModelOutput), dataclasses,
    and the attributes of any other object, down to `depth` levels."""
    seen: set[int] = set()

    def walk(v, level):
        if isinstance(v, torch.Tensor):
            yield v
            return
        if level == 0 or v is None or isinstance(v, (str, bytes, int, float, bool)) or id(v) in seen:
            return
        seen.add(id(v))
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, (list, tuple, set, frozenset)):
            items = v
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            items = [getattr(v, f.name) for f in dataclasses.fields(v)]
        elif isinstance(v, torch.nn.Module):  # a module in an output is not an output
            return
        elif hasattr(v, "__dict__"):
            items = vars(v).values()
        else:
            return
        for item in items:
            yield from walk(item, level - 1)

    yield from walk(value, depth)
