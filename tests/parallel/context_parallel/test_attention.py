"""Ring and Ulysses attention against ordinary causal attention over the whole sequence: every rank's output and
its gradients of q, k and v, float64, to 1e-12; and the load-balanced layout's positions."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minitrain.parallel.context_parallel.layout import ContextLayout
from tests.helpers.dist import run_ranks

B, HEADS, T, D = 2, 4, 16, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, HEADS, T, D, dtype=torch.float64, generator=g) for _ in range(4))
    return q, k, v, w


def _whole():
    q, k, v, w = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_inputs()))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (y * w).sum().backward()
    return y.detach(), q.grad, k.grad, v.grad


def _on_ranks(topo, style):
    from minitrain.parallel.context_parallel.apply import STYLES

    layout = ContextLayout(topo.rank, topo.world_size)
    q, k, v, w = (layout.local(t, dim=2) for t in _inputs())
    for t in (q, k, v):
        t.requires_grad_()
    y = STYLES[style](q, k, v, comm=topo.dp, layout=layout)
    (y * w).sum().backward()
    return y.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("style,ranks", [("ring", 2), ("ring", 4), ("ulysses", 2), ("ulysses", 4)])
def test_each_rank_gets_its_tokens_of_whole_sequence_attention_and_their_gradients(style, ranks):
    want = _whole()
    for rank, got in enumerate(run_ranks(_on_ranks, ranks, style)):
        layout = ContextLayout(rank, ranks)
        for name, ours, theirs in zip(("out", "dq", "dk", "dv"), got, want):
            assert (ours - layout.local(theirs, dim=2)).abs().max() <= 1e-12, (style, ranks, rank, name)


def test_the_layout_pairs_an_early_chunk_with_a_late_one_so_the_causal_work_is_even():
    T_, N = 16, 4
    held = [ContextLayout(r, N).positions(T_) for r in range(N)]
    assert sorted(torch.cat(held).tolist()) == list(range(T_))  # every token once
    assert held[0].tolist() == [0, 1, 14, 15] and held[3].tolist() == [6, 7, 8, 9]
    work = [int(sum(p + 1 for p in h.tolist())) for h in held]  # keys each rank's queries see under the mask
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="does not cut into 2 x cp = 8 equal chunks"):
        ContextLayout(0, N).local(torch.zeros(1, 12))


@pytest.mark.parametrize("causal", [True, False])
def test_a_block_spelt_out_equals_the_fused_kernel_and_its_gradients(causal):
    from minitrain.parallel.context_parallel.blocks import block_attention, block_gradients

    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(2, 3, 8, 4, dtype=torch.float64, generator=g) for _ in range(4))
    if not causal:  # queries against another block of keys, of another length
        k, v = k[:, :, :6], v[:, :, :6]
    (fo, fl), (eo, el) = (block_attention(q, k, v, causal, fused=f) for f in (True, False))
    assert (fo - eo).abs().max() <= 1e-12 and (fl - el).abs().max() <= 1e-12
    fused, spelt = (block_gradients(dout, q, k, v, fo, fl, causal, fused=f) for f in (True, False))
    assert all((a - b).abs().max() <= 1e-12 for a, b in zip(fused, spelt))
