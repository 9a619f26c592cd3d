"""Ring attention: each rank keeps the queries of its own tokens, and the keys and values go round the ring.

With N ranks, step j gives rank r the keys and values of rank r - j. Rank r holds chunks r and 2N - 1 - r of the
sequence (layout.py), so under the causal mask each step is one plain block of attention:
- step 0, its own keys: causal attention over its two chunks (they are in sequence order side by side);
- keys from a rank before it (r - j >= 0): all its queries against the first of those chunks, no mask (the second
  comes after every query of r);
- keys from a rank after it: its second chunk's queries against both of those chunks, no mask (its first chunk
  comes before all of them).
Every rank computes the same amount, half of the N blocks of a full square, as one process does over the whole
sequence. Each block gives its output and, per query, the log of its sum of exponentials (lse); the online
softmax folds them into one output, exactly the softmax over every key. The backward goes round again: each block's
gradients are computed against the final output and lse, the query gradients kept, the key and value gradients
added to the ones that travel with the block; one more pass takes those home (Liu et al. 2023, "Ring Attention
with Blockwise Transformers").

A block runs in the fused kernel where PyTorch has one that returns the lse (the CPU's flash attention), else in
explicit arithmetic (blocks.py). Only keys, values and their gradients travel, N times per layer and pass; no rank
holds the whole sequence's keys. A step's transfer follows its compute here (the teaching order); overlapping the
next block's transfer with this block's compute is what a fast implementation adds.
"""
from __future__ import annotations

import torch

from ...runtime.comm import Comm
from .blocks import block_attention, block_gradients
from .layout import ContextLayout


def pass_on(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    """Send `tensor` to the next rank of the ring, and return what the previous rank sent (the same shape)."""
    received = tensor.new_empty(tensor.shape)
    ahead, behind = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    for send in comm.exchange([(tensor.contiguous(), ahead)], [(received, behind)]):
        send.wait()
    return received


def block_of(step: int, rank: int, ranks: int, local: int) -> tuple[slice, slice, bool]:
    """(this rank's query rows, the visiting block's key rows, causal) at a ring step (see the module docstring)."""
    half = local // 2
    if step == 0:
        return slice(None), slice(None), True
    if (rank - step) % ranks < rank:  # keys of an earlier rank: its first chunk only, for every query
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False  # of a later rank: both chunks, for the second chunk's queries


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) + causal mask) v over the whole sequence, from this rank's (B, heads, T/N, d)."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, layout: ContextLayout):
        wide = torch.promote_types(q.dtype, torch.float32)  # the online softmax sums in float32 at least
        out = torch.zeros(q.shape, dtype=wide, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)
        block = torch.stack([k, v])
        for step in range(comm.world_size):
            rows, keys, causal = block_of(step, comm.rank, comm.world_size, q.size(-2))
            o, l = block_attention(q[:, :, rows], block[0][:, :, keys], block[1][:, :, keys], causal)
            merged = torch.logaddexp(lse[:, :, rows], l)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(-1)
                               + o.to(wide) * torch.exp(l - merged).unsqueeze(-1))
            lse[:, :, rows] = merged
            if step < comm.world_size - 1:
                block = pass_on(comm, block)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm = comm
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm = ctx.comm
        grad_q = torch.zeros_like(q)
        block, block_grad = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(comm.world_size):
            rows, keys, causal = block_of(step, comm.rank, comm.world_size, q.size(-2))
            dq, dk, dv = block_gradients(grad_out[:, :, rows], q[:, :, rows], block[0][:, :, keys],
                                         block[1][:, :, keys], out[:, :, rows], lse[:, :, rows], causal)
            grad_q[:, :, rows] += dq
            block_grad[0][:, :, keys] += dk
            block_grad[1][:, :, keys] += dv
            if step < comm.world_size - 1:  # the block and its gradient so far go on together
                both = pass_on(comm, torch.stack([block, block_grad]))
                block, block_grad = both[0], both[1]
        home = pass_on(comm, block_grad)  # after N - 1 passes a block is one rank short of its owner
        return grad_q, home[0], home[1], None, None


def ring_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: Comm,
                layout: ContextLayout) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, by ring (see the module docstring)."""
    return RingAttention.apply(q, k, v, comm, layout)
