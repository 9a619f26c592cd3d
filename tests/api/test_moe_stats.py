"""minitrain.moe_stats(model) in a user's loop: a mixture of experts' load and router loss over every rank, as
one process counts them over the whole batch, for a Hugging Face MoE (its own output_router_logits loss) and
MiniGPT; an evaluation's forward and activation checkpointing's replay count nothing; a dense model has none."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist import run_ranks
from tests.helpers.hf_models import OPTIMIZERS, SEQ, batches, make_model, tiny_moe

STEPS, BATCH, TOP_K = 3, 8, 2


def _step_loss(model, x):
    """The loss a user's loop writes for a Hugging Face MoE: the next-token cross-entropy (in float64) plus the
    router loss the model computes, with its own coefficient."""
    out = model(input_ids=x)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.size(-1)), x[:, 1:].reshape(-1))
    return ce + model.config.router_aux_loss_coef * out.aux_loss


def _hf_ranks(topo, ep, zero, recompute):
    import minitrain

    minitrain.init_distributed(topology=topo)
    model, optimizer = minitrain.prepare(tiny_moe(output_router_logits=True), OPTIMIZERS["adamw"], zero=zero, ep=ep,
                                         ep_plan="auto" if ep > 1 else None, activation_checkpointing=recompute)
    rank, world = minitrain.dp_rank(), minitrain.dp_world_size()
    stats = []
    for x in batches(STEPS, BATCH):
        share = x.chunk(world)[rank]
        _step_loss(model, share).backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()  # an evaluation's forwards count nothing
        with torch.no_grad():
            model(input_ids=share)
        model.train()
        stats.append(minitrain.moe_stats(model))
    state = {k: v.clone() for k, v in minitrain.full_state_dict(model).items()}
    dense, _ = minitrain.prepare(make_model("llama"), OPTIMIZERS["adamw"])
    none = minitrain.moe_stats(dense)
    minitrain.cleanup()
    return stats, state, none


@pytest.mark.parametrize("world,ep,zero,recompute", [(2, 1, 1, "none"), (2, 2, 3, "model.layers.*")])
def test_a_hugging_face_moe_reports_the_load_and_router_loss_one_process_counts(world, ep, zero, recompute):
    # Hugging Face computes its balancing loss over the tokens of each forward, so each rank's is over its own
    # share: the reference is one process over the shares, the loss their mean, as data parallelism averages it.
    plain = tiny_moe(output_router_logits=True)
    optimizer = OPTIMIZERS["adamw"](plain.parameters())
    want = []
    for x in batches(STEPS, BATCH):
        shares = x.chunk(world)
        router, load = 0.0, [torch.zeros(4, dtype=torch.float64) for _ in range(2)]
        total = 0.0
        for share in shares:
            out = plain(input_ids=share)
            router += plain.config.router_aux_loss_coef * out.aux_loss.item() / world
            for layer, logits in enumerate(out.router_logits):
                chosen = logits.softmax(-1).topk(TOP_K, dim=-1).indices
                load[layer] += torch.bincount(chosen.reshape(-1), minlength=4)
            total = total + _step_loss(plain, share) / world
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append((router, [layer.tolist() for layer in load]))
    for stats, state, none in run_ranks(_hf_ranks, world, ep, zero, recompute):
        assert none is None  # a dense model has no mixture to report
        for got, (router, load) in zip(stats, want):
            assert abs(got.router_loss - router) <= 1e-12, (got.router_loss, router)
            assert got.load == load and got.dropped == [0.0, 0.0]  # every slot of the batch, once
            assert sum(map(sum, got.load)) == 2 * BATCH * SEQ * TOP_K
        ref = plain.state_dict()  # and the router loss trained as one process trains it
        assert max((state[k] - ref[k]).abs().max().item() for k in ref) <= 1e-12


def _minigpt_ranks(topo):
    import minitrain
    from minitrain.config import ModelConfig
    from minitrain.models.minigpt.model import MiniGPT

    minitrain.init_distributed(topology=topo)
    torch.manual_seed(0)
    cfg = ModelConfig(moe_experts=4, moe_top_k=TOP_K, moe_aux_loss_coef=0.05, moe_z_loss_coef=0.001)
    model, optimizer = minitrain.prepare(MiniGPT(cfg).double(), OPTIMIZERS["adamw"])
    x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(3))
    share = x.chunk(minitrain.dp_world_size())[minitrain.dp_rank()]
    model(share[:, :-1], share[:, 1:]).backward()
    optimizer.step()
    stats = minitrain.moe_stats(model)
    minitrain.cleanup()
    return stats


def test_minigpt_through_prepare_reports_the_global_balance_loss_of_the_whole_batch():
    from minitrain.config import ModelConfig
    from minitrain.models.minigpt.model import MiniGPT

    torch.manual_seed(0)
    plain = MiniGPT(ModelConfig(moe_experts=4, moe_top_k=TOP_K, moe_aux_loss_coef=0.05,
                                moe_z_loss_coef=0.001)).double()
    x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(3))
    plain(x[:, :-1], x[:, 1:])
    router = sum(layer.aux_loss.item() for layer in plain.moe_layers())
    load = [layer.take_load().load for layer in plain.moe_layers()]
    for stats in run_ranks(_minigpt_ranks, 2):
        assert abs(stats.router_loss - router) <= 1e-12 and stats.load == load
        assert stats.imbalance >= 1.0 and stats.dropped_share == 0.0
