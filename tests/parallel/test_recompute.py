"""Activation checkpointing: the same gradients as storing everything (float64), less stored."""
import pytest
import torch


from minitrain.train.run_config import run_config
from minitrain.train.memory import saved_activation_bytes
from minitrain.models.minigpt.model import CausalSelfAttention, MiniGPT
from minitrain.models.minigpt.plan import MINIGPT_PLAN
from minitrain.parallel.recompute import apply_activation_checkpointing
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_ranks

MODES = ("none", "block", "selective")


def _model(mode, attention):
    cfg = run_config(cli_values={"model.n_layer": 3, "model.attention": attention})
    torch.manual_seed(0)
    return apply_activation_checkpointing(MiniGPT(cfg.model).double(), mode, MINIGPT_PLAN), cfg


def _backward_counting(mode, attention):
    """Gradients, bytes autograd stored outside recomputed regions, and attention-core calls."""
    calls = []
    original = CausalSelfAttention.attend

    def counted(self, q, k, v):  # every run of the attention core, in forward or replayed in backward
        calls.append(1)
        return original(self, q, k, v)

    CausalSelfAttention.attend = counted  # before wrapping, so the recompute wrapper replays the counter
    model, cfg = _model(mode, attention)
    torch.manual_seed(1)
    x = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len))
    try:
        with saved_activation_bytes(model) as stored:
            model(x, x).backward()
    finally:
        CausalSelfAttention.attend = original
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stored["bytes"], len(calls)


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_recomputation_gives_identical_gradients_and_stores_less(attention):
    grads, stored, calls = {}, {}, {}
    for mode in MODES:
        grads[mode], stored[mode], calls[mode] = _backward_counting(mode, attention)
    for mode in ("block", "selective"):
        for name, g in grads["none"].items():
            assert torch.equal(grads[mode][name], g), f"{mode}: {name}"  # exactly; the bound is 1e-12
    assert calls == {"none": 3, "block": 6, "selective": 6}  # 3 layers; each core runs again in backward
    assert stored["block"] < stored["selective"] < stored["none"]


def _train_every_mode(topo, zero):
    out = {}
    for mode in MODES:
        cfg = run_config(cli_values={"train.zero": zero, "train.dtype": "float64", "dist.nproc": topo.world_size,
                                       "train.activation_checkpointing": mode, "train.log_every": 0})
        trainer = Trainer(cfg, topo)
        out[mode] = ([trainer.train_step().loss for _ in range(3)], trainer.strategy.full_params())
    return out


@pytest.mark.parametrize("zero", [0, 3])
def test_every_mode_trains_identically_under_data_parallel_and_zero3(zero):
    result = run_ranks(_train_every_mode, 2, zero)[0]
    losses, params = result["none"]
    for mode in ("block", "selective"):
        assert max(abs(a - b) for a, b in zip(result[mode][0], losses)) <= 1e-12
        assert (result[mode][1] - params).abs().max().item() <= 1e-12
