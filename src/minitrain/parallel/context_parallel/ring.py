"""Ring attention: each rank keeps the queries of its own tokens, and the keys and values go round the ring.

With N ranks, step j gives rank r the keys and values of rank r - j: it scores its queries against them under the
causal mask (by the tokens' positions in the whole sequence, layout.py) and folds the result into what it has so
far with the online softmax, keeping per query the log of the sum of exponentials (lse): after N steps its
output is the softmax over every key of the sequence, exactly. The backward goes round again: each rank
recomputes the probabilities of every block from the saved lse, adds its gradient of the queries, and adds its
share of the visiting block's key and value gradients to the ones that travel with the block; one more pass takes
those gradients home (Liu et al. 2023, "Ring Attention with Blockwise Transformers").

Only (keys, values) and their gradients travel, N times per layer and pass; no rank ever holds the whole
sequence's keys. Here a step's transfer follows its compute (the teaching order); overlapping the next block's
transfer with this block's compute is what a fast kernel adds.
"""
from __future__ import annotations

import math

import torch

from ...runtime.comm import Comm
from .layout import ContextLayout


def pass_on(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    """Send `tensor` to the next rank of the ring, and return what the previous rank sent (the same shape)."""
    received = tensor.new_empty(tensor.shape)
    ahead, behind = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    for send in comm.exchange([(tensor.contiguous(), ahead)], [(received, behind)]):
        send.wait()
    return received


def masked_scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """q k^T / sqrt(head_dim), -inf where a key comes after the query in the whole sequence."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) + causal mask) v over the whole sequence, from this rank's (B, heads, T/N, d)."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, layout: ContextLayout):
        T = q.size(-2) * comm.world_size
        q_pos = layout.positions(T, device=q.device)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        block = torch.stack([k, v])
        for step in range(comm.world_size):  # its own block first: every query sees at least itself
            source = (comm.rank - step) % comm.world_size
            scores = masked_scores(q, block[0], q_pos, layout.positions(T, source, q.device))
            merged = torch.logaddexp(lse, torch.logsumexp(scores, dim=-1))
            out = out * torch.exp(lse - merged).unsqueeze(-1) + torch.exp(scores - merged.unsqueeze(-1)) @ block[1]
            lse = merged
            if step < comm.world_size - 1:
                block = pass_on(comm, block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout = comm, layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout = ctx.comm, ctx.layout
        T, scale = q.size(-2) * comm.world_size, 1 / math.sqrt(q.size(-1))
        q_pos = layout.positions(T, device=q.device)
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # d(softmax) needs rowsum(dO * O)
        grad_q = torch.zeros_like(q)
        block, block_grad = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(comm.world_size):
            source = (comm.rank - step) % comm.world_size
            k_b, v_b = block[0], block[1]
            probs = torch.exp(masked_scores(q, k_b, q_pos, layout.positions(T, source, q.device))
                              - lse.unsqueeze(-1))
            grad_scores = probs * (grad_out @ v_b.transpose(-2, -1) - delta)
            grad_q += grad_scores @ k_b * scale
            block_grad = block_grad + torch.stack([grad_scores.transpose(-2, -1) @ q * scale,
                                                   probs.transpose(-2, -1) @ grad_out])
            if step < comm.world_size - 1:  # the block and its gradient so far go on together
                both = pass_on(comm, torch.stack([block, block_grad]))
                block, block_grad = both[0], both[1]
        home = pass_on(comm, block_grad)  # after N - 1 passes a block is one rank short of its owner
        return grad_q, home[0], home[1], None, None


def ring_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm: Comm,
                layout: ContextLayout) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, by ring (see the module docstring)."""
    compute = torch.promote_types(q.dtype, torch.float32)  # 16-bit inputs: the softmax sums in float32
    out = RingAttention.apply(q.to(compute), k.to(compute), v.to(compute), comm, layout)
    return out.to(q.dtype)
