"""--train.compile: torch.compile each transformer block's forward, in place.

The block's `forward` is compiled, not the module's whole call (`nn.Module.compile`), so module
hooks stay outside the compiled code: ZeRO-3 gathers a block's parameters in a forward pre-hook
and before its backward, and a collective inside a compiled graph would break it in pieces. It
comes after the tensor-parallel split and the pipeline cut (it compiles the layers this rank
runs) and before activation checkpointing, which wraps the compiled forward and replays it in
backward. Compilation is lazy: the first step traces and compiles each block (slow once).
"""
from __future__ import annotations

import torch
from torch import nn

from .core.units import repeated_blocks


def compile_blocks(model: nn.Module, plan=None) -> None:
    """plan: the model's ModelPlan (its `blocks`), or None to use its list of layers."""
    blocks = plan.blocks(model) if plan is not None and plan.blocks else repeated_blocks(model)
    if not blocks:
        raise ValueError(f"compile found no blocks in {type(model).__name__} (no ModuleList or ModuleDict of "
                         "layers); give a plan that names them")
    for block in blocks:
        block.forward = torch.compile(block.forward)
