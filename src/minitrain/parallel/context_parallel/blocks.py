"""One block of attention for ring attention (ring.py): queries against a block of keys, with or without the
causal mask, giving the output and the per-query log-sum-exp (lse), and the block's gradients computed against the
whole output and lse (which is how the blocks' gradients add up to the whole softmax's).

Where PyTorch has a fused kernel that returns the lse (the CPU's flash attention) a block runs in it: no (queries
x keys) scores are held. Elsewhere the same arithmetic is spelt out, the scores of one block at a time; the two
agree to 1e-12 in float64 (tests/parallel/context_parallel/test_attention.py runs both).
"""
from __future__ import annotations

import math

import torch


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T / sqrt(d) [+ causal mask]) v, logsumexp of the scores per query)."""
    if _fused(q) if fused is None else fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    scores = _scores(q, k, causal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype) @ v, lse


def block_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, fused: bool | None = None):
    """(dq, dk, dv) of this block, given the whole attention's output `out` and `lse` for these queries."""
    if _fused(q) if fused is None else fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.to(torch.promote_types(q.dtype, torch.float32)), 0.0, causal)
    scale = 1 / math.sqrt(q.size(-1))
    probs = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))
    delta = (grad_out.to(probs.dtype) * out.to(probs.dtype)).sum(dim=-1, keepdim=True)  # rowsum(dO * O)
    grad_scores = probs * (grad_out.to(probs.dtype) @ v.to(probs.dtype).transpose(-2, -1) - delta)
    return ((grad_scores @ k.to(probs.dtype) * scale).to(q.dtype),
            (grad_scores.transpose(-2, -1) @ q.to(probs.dtype) * scale).to(k.dtype),
            (probs.transpose(-2, -1) @ grad_out.to(probs.dtype)).to(v.dtype))


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """q k^T / sqrt(d) in float32 at least, -inf above the diagonal when causal (q and k the same positions)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(wide) @ k.to(wide).transpose(-2, -1)) / math.sqrt(q.size(-1))
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores
