"""Which parameters ZeRO-2 and ZeRO-3 move together: one unit per block.

A unit is reduce-scattered as one gradient bucket (ZeRO-2 and 3) and gathered
as one parameter buffer just before it computes (ZeRO-3). The units are the
model's top-level submodules, with containers (ModuleDict, ModuleList) opened
one level: for MiniGPT that is tok_emb, pos_emb, each transformer block, ln_f
and head, in the order forward calls them. Coarser units mean fewer, larger
collectives; finer ones a smaller gathered working set (FSDP's trade-off,
where torchtitan also wraps each block).

A parameter used by more than one unit (tied embedding and head weights) or
held by the model itself belongs to none of them: it goes into a first unit,
"shared", with no module, which ZeRO-3 gathers when forward starts and frees
once its gradient has been reduced.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch.nn as nn


@dataclass
class UnitPlan:
    name: str
    module: nn.Module | None  # None for the "shared" unit
    params: list[str]  # canonical names (as in model.named_parameters())


def module_units(model: nn.Module) -> list[UnitPlan]:
    canonical = {id(p): name for name, p in model.named_parameters()}
    candidates: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            candidates += [(f"{name}.{key}", grandchild) for key, grandchild in child.named_children()]
        else:
            candidates.append((name, child))
    owners: dict[int, list[str]] = defaultdict(list)
    for unit_name, module in candidates:
        for p in module.parameters():
            owners[id(p)].append(unit_name)
    shared = [name for pid, name in canonical.items() if len(owners[pid]) != 1]
    plans = [UnitPlan("shared", None, shared)] if shared else []
    for unit_name, module in candidates:
        names = [canonical[id(p)] for p in module.parameters() if len(owners[id(p)]) == 1]
        if names:
            plans.append(UnitPlan(unit_name, module, names))
    return plans


def unit_layout(plans: list[UnitPlan]) -> list[tuple[str, list[str]]]:
    """The (name, parameter names) list FlatParameters lays out."""
    return [(plan.name, plan.params) for plan in plans]
