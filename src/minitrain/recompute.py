"""Activation checkpointing: keep less of the forward pass for backward, recompute the rest.

`apply_activation_checkpointing(model, mode)` changes an unmodified MiniGPT from the outside:
- "block": each transformer block keeps only its input; its whole forward runs again inside
  backward. Activation memory falls from every block's intermediates to one block's plus the
  block inputs, for about one extra forward of the blocks (~1/3 more compute).
- "selective": only the attention core (`CausalSelfAttention.attend`: scores, mask, softmax,
  weighted sum) is recomputed, as in Korthikanti et al. 2022 ("Reducing Activation Recomputation
  in Large Transformer Models"). It holds the two (B, heads, T, T) tensors per layer, the part
  that grows with T^2, yet costs few FLOPs next to the matrix multiplies with weights.
Both use PyTorch's non-reentrant `torch.utils.checkpoint`, which replays the same operations on
the same inputs (and restores the RNG state), so gradients are exactly those of the plain run.

The wrapper replaces the module's `forward` attribute, so module hooks still fire around the
call: ZeRO-3 gathers a block's parameters in its forward pre-hook and again before the block's
backward, which is when the recomputation runs.
"""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "block", "selective")


def _recomputed(fn):
    @functools.wraps(fn)
    def run(*args):
        return checkpoint(fn, *args, use_reentrant=False)

    return run


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "none":
        return model
    for block in model.blocks.values():
        if mode == "block":
            block.forward = _recomputed(block.forward)
        else:
            block.attn.attend = _recomputed(block.attn.attend)
    return model
