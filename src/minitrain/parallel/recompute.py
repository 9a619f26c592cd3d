"""Activation checkpointing: keep less of the forward pass for backward, recompute the rest.

`apply_activation_checkpointing(model, mode, plan)` changes a model from the outside:
- "block": each transformer block keeps only its input; its whole forward runs again inside
  backward. Activation memory falls from every block's intermediates to one block's plus the
  block inputs, for about one extra forward of the blocks (~1/3 more compute). The blocks are
  the plan's, or for a model without one the elements of its containers (units.repeated_blocks:
  MiniGPT's `blocks`, a Hugging Face model's `layers` or `h`).
- "selective": only the parts the model's plan names are recomputed; for MiniGPT the attention
  core (`CausalSelfAttention.attend`: scores, mask, softmax, weighted sum), as in Korthikanti et
  al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"). It holds the two
  (B, heads, T, T) tensors per layer, the part that grows with T^2, yet costs few FLOPs next to
  the matrix multiplies with weights.
- a module-name pattern (`"model.layers.*"`, matched segment by segment as tensor-parallel plans are)
  or an nn.Module class (`LlamaDecoderLayer`): "block" recomputation of exactly the modules named.
Both use PyTorch's non-reentrant `torch.utils.checkpoint`, which replays the same operations on
the same inputs (and restores the RNG state), so gradients are exactly those of the plain run.

The wrapper replaces the method on the module instance rather than wrapping the module in
another (as torch's `checkpoint_wrapper` does), so parameter names and state_dict keys do not
change and module hooks still fire around the call: ZeRO-3 gathers a block's parameters in its
forward pre-hook and again before the block's backward, which is when the recomputation runs.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .core.model_plan import matches
from .core.units import repeated_blocks

MODES = ("none", "block", "selective")


def in_backward() -> bool:
    """True while autograd runs a backward pass: a forward now is activation checkpointing's recomputation."""
    return torch._C._current_graph_task_id() != -1


def _recomputed(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return run


def targets(model: nn.Module, which: str | type) -> list[nn.Module]:
    """The modules a pattern or a class names (not nested in one another: the outermost are kept); ValueError
    if none."""
    if isinstance(which, type):
        found = [(name, m) for name, m in model.named_modules() if isinstance(m, which)]
        what = f"class {which.__name__}"
    else:
        found = [(name, m) for name, m in model.named_modules() if name and matches(which, name)]
        what = f"pattern '{which}'"
    if not found:
        raise ValueError(f"activation_checkpointing {what} matches no module of {type(model).__name__}")
    outer = [(name, m) for name, m in found
             if not any(name.startswith(other + ".") for other, _ in found if other)]
    return [m for _, m in outer]


def apply_activation_checkpointing(model: nn.Module, mode: str | type, plan=None) -> nn.Module:
    """mode: none | block | selective, a module-name pattern, or a module class. plan: the model's
    ModelPlan (models/minigpt/plan.py has MiniGPT's), or None for a model without one."""
    if isinstance(mode, type) or (isinstance(mode, str) and mode not in MODES and mode.strip()):
        if isinstance(mode, type) and not issubclass(mode, nn.Module):
            raise ValueError(f"activation_checkpointing={mode.__name__} is not an nn.Module class")
        for module in targets(model, mode):
            module.forward = _recomputed(module.forward)
        return model
    if mode not in MODES:
        raise ValueError(f"activation checkpointing must be one of {', '.join(MODES)}, a module-name pattern or "
                         f"a module class; got {mode!r}")
    if mode == "none":
        return model
    if mode == "block":
        blocks = plan.blocks(model) if plan is not None and plan.blocks else repeated_blocks(model)
        if not blocks:
            raise ValueError(f"activation_checkpointing='block' found no blocks in {type(model).__name__} (no "
                             "ModuleList or ModuleDict of layers); give a plan that names them")
        for block in blocks:
            block.forward = _recomputed(block.forward)
        return model
    if plan is None or plan.selective is None:
        raise ValueError(f"activation_checkpointing='selective' needs a plan naming what to recompute in "
                         f"{type(model).__name__}; use 'block', which works on any model with a list of layers")
    for module, method in plan.selective(model):
        setattr(module, method, _recomputed(getattr(module, method)))
    return model
