"""Ulysses attention (DeepSpeed-Ulysses, Jacobs et al. 2023): trade the sequence split for a head split.

Each rank holds every head for its 1/N of the tokens. One all-to-all gives each rank 1/N of the heads for all the
tokens; attention per head needs nothing else, so each rank runs ordinary causal attention over the whole
sequence for its heads; a second all-to-all gives the tokens back. Four all-to-alls per layer and pass (q, k, v
in, the output back; their adjoints in backward), each moving 1/N of the activations, whatever N: the heads must
divide by N.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...runtime.comm import Comm
from .layout import ContextLayout


class AllToAll(torch.autograd.Function):
    """Block i of dim 0 to rank i; rank i's block for this rank arrives at i. Its own adjoint: backward sends
    the gradient the same way."""

    @staticmethod
    def forward(ctx, blocks: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        out = blocks.new_empty(blocks.shape)  # contiguous, whatever the input's strides
        comm.all_to_all(out, blocks.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(grad.shape)
        ctx.comm.all_to_all(back, grad.contiguous())
        return back, None


def ulysses_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: Comm,
                   layout: ContextLayout) -> torch.Tensor:
    """Causal attention of this rank's (B, heads, T/N, d) queries over the whole sequence, by head."""
    N = comm.world_size
    B, heads, local, d = q.shape
    if heads % N:
        raise ValueError(f"Ulysses attention splits the {heads} heads over cp = {N} ranks, which does not divide "
                         "them; use a cp that divides the heads, or the ring style")
    # Where the tokens of rank 0, 1, ... (each its two chunks) sit in the whole sequence, and the inverse.
    held = torch.cat([layout.positions(local * N, r, q.device) for r in range(N)])
    natural = torch.argsort(held)

    def by_head(x: torch.Tensor) -> torch.Tensor:  # (B, heads, T/N, d) -> (B, heads/N, T, d), in sequence order
        blocks = x.reshape(B, N, heads // N, local, d).transpose(0, 1)  # block g: head group g, for rank g
        tokens = AllToAll.apply(blocks, comm)  # block r: rank r's tokens of this rank's heads
        return tokens.permute(1, 2, 0, 3, 4).reshape(B, heads // N, N * local, d)[:, :, natural]

    y = F.scaled_dot_product_attention(by_head(q), by_head(k), by_head(v), is_causal=True)
    blocks = y[:, :, held].reshape(B, heads // N, N, local, d).permute(2, 0, 1, 3, 4)  # block r: rank r's tokens
    mine = AllToAll.apply(blocks, comm)  # block g: this rank's tokens of head group g
    return mine.transpose(0, 1).reshape(B, heads, local, d)
