"""MiniGPT's mixture of experts (models/minigpt/moe.py): routing as written out token by token, the capacity drop,
the auxiliary losses in the gradient and not in the logged loss, load counted once under activation
checkpointing, and data parallel / ZeRO 0-3 equal to plain PyTorch in one process."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from minitrain.config import ModelConfig
from minitrain.models.minigpt.model import MiniGPT
from minitrain.models.minigpt.moe import MoEMLP
from minitrain.parallel.expert_parallel.load import ExpertLoad

from tests.helpers.dist import run_main, run_ranks
from tests.helpers.hf_models import tiny_moe
from tests.helpers.refusal import refusal
from tests.helpers.numerics import assert_bit_equal
from tests.helpers.reference import assert_close_to, plain_run

pytestmark = pytest.mark.slow

E, K = 4, 2


def _layer(top_k=K, capacity=0.0, aux=0.01, z=0.0, experts=E) -> MoEMLP:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=8, d_ff=16, n_head=2, moe_experts=experts, moe_top_k=top_k,
                      moe_capacity_factor=capacity, moe_aux_loss_coef=aux, moe_z_loss_coef=z)
    return MoEMLP(cfg).double()


def _by_hand(layer: MoEMLP, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Each token through its top-k experts one at a time, weighted; with a capacity, an expert's slots past the
    first `capacity` (token-major order: token t's j-th choice before token t+1's) add nothing."""
    tokens = x.reshape(-1, x.size(-1))
    taken = [0] * layer.experts
    out = torch.zeros_like(tokens)
    for t, token in enumerate(tokens):
        probs = F.softmax(token @ layer.router.weight.T, dim=-1)
        weights, chosen = probs.topk(layer.top_k)
        weights = weights / weights.sum() if layer.top_k > 1 else weights
        for w, e in zip(weights, chosen.tolist()):
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                continue
            h = F.gelu(layer.up[e] @ token + layer.up_bias[e])
            out[t] += w * (layer.down[e] @ h + layer.down_bias[e])
    return out.view_as(x)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_routing_equals_each_token_through_its_experts_by_hand(top_k):
    layer = _layer(top_k=top_k)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    assert (layer(x) - _by_hand(layer, x)).abs().max() <= 1e-12
    counted = layer.take_load()
    assert sum(counted.load) == 15 * top_k and counted.dropped == 0  # dropless: every slot computed
    assert counted.forwards == 1 and float(counted.router_loss) == float(layer.aux_loss.detach()) > 0
    assert layer.take_load() == ExpertLoad([0.0] * E)  # taken: the counters start over
    layer.eval()
    layer(x)
    assert layer.take_load() == ExpertLoad([0.0] * E)  # an evaluation's forward is not the step's load


def test_under_autocast_the_experts_16_bit_outputs_are_combined():
    # On a GPU autocast runs the layer norm before the router in float32 and the experts' matrix multiplies in
    # bf16; their outputs are gathered in their own dtype. On the CPU: a float32 input, bf16 multiplies.
    layer = _layer().float()
    x = torch.randn(3, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16 and (out.float() - layer(x)).abs().max() <= 1e-2


def test_a_capacity_drops_the_later_slots_of_a_full_expert_and_counts_them():
    layer = _layer(capacity=0.5)
    x = torch.randn(2, 8, 8, dtype=torch.float64)
    capacity = math.ceil(0.5 * 16 * K / E)  # 4 slots per expert
    assert (layer(x) - _by_hand(layer, x, capacity)).abs().max() <= 1e-12
    counted = layer.take_load()
    assert sum(counted.load) == 16 * K and counted.dropped == sum(max(0, n - capacity) for n in counted.load) > 0


def test_an_expert_no_token_chooses_gets_a_zero_gradient_not_none():
    layer = _layer()
    with torch.no_grad():
        layer.router.weight[3] = -100.0  # for positive inputs expert 3 is never among the top 2
    x = torch.rand(4, 8, dtype=torch.float64)
    layer(x).sum().backward()
    assert layer.take_load().load[3] == 0
    assert layer.up.grad is not None and layer.up.grad[3].abs().max() == 0 and layer.up.grad[:3].abs().max() > 0


def _model(**moe) -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(ModelConfig(moe_experts=E, moe_top_k=K, **moe)).double()


def test_the_auxiliary_losses_count_in_the_gradient_not_in_the_logged_loss():
    model = _model(moe_aux_loss_coef=0.05, moe_z_loss_coef=0.001)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    loss = model(x, y)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # By hand: the cross-entropy, plus each layer's balance and z-loss as the papers write them.
    logits = model(x)
    ce = F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
    extra = 0.0
    hidden = model.embed(x)
    for block in model.blocks.values():
        mid = hidden + block.attn(block.ln1(hidden))
        tokens = block.ln2(mid).reshape(-1, 32)
        router_logits = block.mlp.router(tokens)
        probs = router_logits.softmax(-1)
        counts = torch.bincount(probs.topk(K, dim=-1).indices.reshape(-1), minlength=E).double()
        balance = E * ((counts / counts.sum()) * probs.mean(0)).sum()
        z = torch.logsumexp(router_logits, -1).pow(2).mean()
        extra = extra + 0.05 * balance + 0.001 * z
        hidden = mid + block.mlp(block.ln2(mid))
    assert loss.item() == ce.item()  # the value is the language model's
    (ce + extra).backward()
    assert all((ours[n] - p.grad).abs().max() <= 1e-12 for n, p in model.named_parameters())


def test_activation_checkpointing_counts_the_load_once_and_changes_no_gradient():
    from minitrain.parallel.recompute import apply_activation_checkpointing

    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    got = {}
    for mode in ("none", "block"):
        model = apply_activation_checkpointing(_model(), mode)
        # The whole forward replayed (torch may stop a replay once it has what backward needs, before the count).
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            model(x, y).backward()
        got[mode] = ([m.take_load() for m in model.moe_layers()], {n: p.grad for n, p in model.named_parameters()})
    assert got["block"][0] == got["none"][0] and all(sum(c.load) == 32 * K and c.forwards == 1 for c in got["none"][0])
    assert all(torch.equal(got["block"][1][n], g) for n, g in got["none"][1].items())


STEPS = 4


def _config(world: int, zero: int, accum: int = 1, capacity: float = 0.0, balance: str = "global"):
    from minitrain.train.run_config import run_config

    return run_config(cli_values={
        "model.moe_experts": E, "model.moe_top_k": K, "model.moe_aux_loss_coef": 0.05, "model.moe_z_loss_coef": 0.001,
        "model.moe_capacity_factor": capacity, "model.moe_balance": balance,
        "train.zero": zero, "train.dtype": "float64", "train.steps": STEPS, "train.batch_size": 2,
        "train.grad_accum": accum, "dist.nproc": world, "train.lr": 1e-2, "train.log_every": 0,
        "train.grad_clip": 1.5})


def _train(topo, accum, balance):
    from minitrain.train.trainer import Trainer

    got = {}
    for zero in (0, 1, 2, 3):
        with Trainer(_config(topo.world_size, zero, accum, balance=balance), topo) as trainer:
            records = [trainer.train_step() for _ in range(STEPS)]
            got[zero] = {"losses": [r.loss for r in records], "grad_norms": [r.grad_norm for r in records],
                         "params": trainer.strategy.full_params(), "load": [r.expert_load for r in records],
                         "router_losses": [r.router_loss for r in records]}
    return got


@pytest.mark.parametrize("world,accum,balance", [(2, 1, "global"), (2, 2, "global"), (2, 1, "rank")])
def test_data_parallel_and_zero_train_a_mixture_of_experts_as_one_process_does(world, accum, balance):
    # global: the balancing loss over each micro-batch's tokens on every rank, so the reference is one process
    # on the whole micro-batch. rank: each rank's over its own tokens (as Megatron and DeepSpeed compute it by
    # default), so the reference computes it per rank share, in one process. Both with torch.optim.AdamW
    # (tests/helpers/reference.py).
    ref = plain_run(_config(world, 0, accum, balance=balance), STEPS)
    ranks = run_ranks(_train, world, accum, balance)
    for zero in (0, 1, 2, 3):
        ours = ranks[0][zero]
        assert_close_to(ref, 1e-12, f"MoE ({balance} balance) ZeRO-{zero} at {world} ranks, accumulation {accum}",
                        losses=ours["losses"], grad_norms=ours["grad_norms"], params=ours["params"],
                        router_losses=ours["router_losses"])
        # The load is every rank's: all slots of the step, per layer, counted once.
        tokens = 2 * 16 * world * accum
        assert all(sum(layer[:E]) == tokens * K and layer[E] == 0 for step in ours["load"] for layer in step)


def test_bad_mixture_settings_are_refused_in_one_line(tmp_path):
    for flags, message in ((["--model.moe_experts", "4", "--model.moe_top_k", "5"], "must lie in [1"),
                           (["--model.moe_experts", "-1"], "must be an integer >= 0"),
                           (["--model.moe_experts", "4", "--model.moe_capacity_factor", "-1"], "capacity_factor"),
                           (["--model.moe_experts", "4", "--nproc", "2", "--tp", "2"], "data parallelism and ZeRO")):
        proc = run_main("train", "--out", str(tmp_path / "run"), *flags)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_the_cli_reports_the_expert_load_per_step_and_plots_it(tmp_path):
    import json

    from tests.helpers.dist import run_cli

    out = tmp_path / "run"
    proc = run_cli("train", "--nproc", "2", "--zero", "1", "--steps", "4", "--train.log_every", "2", "--out", str(out),
                   "--model.moe_experts", "4", "--model.moe_capacity_factor", "1.0")
    assert proc.returncode == 0, proc.stderr
    assert "experts max/mean" in proc.stdout and "dropped" in proc.stdout and "router loss" in proc.stdout, proc.stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for step in steps:  # 2 layers of 4 experts and the dropped count; every slot of the step's batch, once
        assert len(step["expert_load"]) == 2 and all(len(layer) == 5 for layer in step["expert_load"])
        assert all(sum(layer[:4]) == step["tokens"] * 2 for layer in step["expert_load"]), step["expert_load"]
        assert 0.01 * 2 <= step["router_loss"] < 0.01 * 2 * 4  # 2 layers' balance at 0.01: 1 if even, E at worst
    report = run_main("report", str(out))
    assert report.returncode == 0 and (out / "report" / "expert_load.png").is_file(), report.stderr


def test_the_plan_counts_every_expert_in_memory_and_top_k_of_them_in_flops():
    from minitrain import plan

    dense = ModelConfig(n_layer=2, d_model=32, n_head=4)
    moe = ModelConfig(n_layer=2, d_model=32, n_head=4, moe_experts=8, moe_top_k=2)
    P_dense, P_moe = plan.model_params(dense), plan.model_params(moe)
    expert = 2 * 32 * 128 + 128 + 32
    assert P_moe == P_dense - 2 * expert + 2 * (8 * expert + 8 * 32)  # 8 experts and a router per layer
    flops = {name: plan.plan(plan.PlanInput(model=m, params=P))["flops_per_token"]
             for name, m, P in (("dense", dense, P_dense), ("moe", moe, P_moe))}
    # A token meets 2 of the 8 experts (and the router): twice a dense MLP's FLOPs, not eight times.
    assert flops["moe"] - flops["dense"] == 6 * 2 * (expert + 8 * 32)
    bytes_ = plan.plan(plan.PlanInput(model=moe, params=P_moe, zero=0))["bytes_per_rank"]
    assert bytes_["params"] == 4 * P_moe  # memory holds every expert


def _whole(trainer, local=None):
    """The whole model's logical vector of a local one (default: the parameters) from every rank's part."""
    from minitrain.parallel.state.whole_state import gather_logical

    s, t = trainer.strategy, trainer.topo
    return gather_logical(s, s.local_params() if local is None else local, t.everyone, t.dp.rank, t.ep.rank)


def _ep_train(topo, ep, capacity=0.0, balance="global"):
    from minitrain.train.trainer import Trainer

    got = {}
    for zero in (0, 3):
        cfg = _config(topo.world_size, zero, capacity=capacity, balance=balance)
        cfg.dist.ep = ep
        with Trainer(cfg, topo) as trainer:
            records = [trainer.train_step() for _ in range(STEPS)]
            got[zero] = {"losses": [r.loss for r in records], "grad_norms": [r.grad_norm for r in records],
                         "params": _whole(trainer), "load": [r.expert_load for r in records],
                         "router_losses": [r.router_loss for r in records], "all_to_all": trainer.topo.ep.stats["all_to_all"].calls,
                         "params_held": trainer.strategy.flat.numel, "comm_calls": sum(r.comm_calls for r in records)}
    return got


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_trains_as_one_process_does(world, ep):
    # Each rank computes E/ep experts for the tokens of its whole group, by all-to-all; the run equals the same
    # plain PyTorch reference as data parallelism over those ranks, at ZeRO-0 and ZeRO-3.
    ref = plain_run(_config(world, 0), STEPS)
    ranks = run_ranks(_ep_train, world, ep)
    for zero in (0, 3):
        ours = ranks[0][zero]
        assert_close_to(ref, 1e-12, f"MoE ep {ep} ZeRO-{zero} at {world} ranks", losses=ours["losses"],
                        grad_norms=ours["grad_norms"], params=ours["params"], router_losses=ours["router_losses"])
        assert all(sum(layer[:E]) == 2 * 16 * world * K for step in ours["load"] for layer in step)
        # Each rank holds the dense parameters and 1/ep of the experts' (2 layers of E experts of MiniGPT's MLP).
        total, experts = ref.params.numel(), 2 * E * (2 * 32 * 128 + 128 + 32)
        assert ours["params_held"] == total - experts + experts // ep
        # Per layer and step: the counts, the rows out and back in forward, the two reverse ones in backward;
        # counted with the step's collectives.
        assert ours["all_to_all"] == STEPS * 2 * 5 and ours["comm_calls"] >= ours["all_to_all"]


def _layer_on_ranks(topo):
    """One MoE layer, the same weights on every rank; rank 1's tokens all choose experts 0 and 1, so it sends
    nothing to rank 1's experts (2 and 3), and expert 3 gets no token from anyone. Returns this rank's output and
    the gradients, with expert parallelism over both ranks and without."""
    from minitrain.parallel.expert_parallel.experts import ExpertParallel

    got = {}
    for ep in (1, 2):
        layer = _layer()
        with torch.no_grad():
            layer.router.weight[3] = -100.0  # never chosen (inputs are positive)
            if topo.rank == 1:
                layer.router.weight[2] = -50.0  # rank 1 routes to 0 and 1 only
            else:
                layer.router.weight[1] += 0.1  # rank 0 to 0, 1 and 2: rank 0's experts get rows from both ranks
        if ep == 2:
            layer.run_experts = ExpertParallel(layer, topo.dp)
        torch.manual_seed(10 + topo.rank)
        x = torch.rand(12, 8, dtype=torch.float64)
        out = layer(x)
        (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        got[ep] = {"out": out.detach(), "load": layer.take_load().load,
                   "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}}
    return got


def _ep_recomputed(topo):
    from minitrain.train.trainer import Trainer

    cfg = _config(topo.world_size, 2)
    cfg.dist.ep, cfg.train.activation_checkpointing = 2, "block"
    with Trainer(cfg, topo) as trainer:
        records = [trainer.train_step() for _ in range(STEPS)]
        return [r.loss for r in records], [r.grad_norm for r in records], _whole(trainer), records[-1].expert_load


def test_expert_parallelism_with_activation_checkpointing_trains_as_one_process_does():
    # Each block replayed in backward runs its all-to-alls again, on every rank alike; ZeRO-2 shards over the
    # experts' replicas. The same reference as without either; the load counted once.
    ref = plain_run(_config(2, 0), STEPS)
    losses, norms, params, load = run_ranks(_ep_recomputed, 2)[0]
    assert_close_to(ref, 1e-12, "MoE ep 2, ZeRO-2, block checkpointing", losses=losses, grad_norms=norms, params=params)
    assert all(sum(layer[:E]) == 2 * 16 * 2 * K for layer in load)


def test_with_a_capacity_expert_parallelism_drops_the_tokens_one_process_drops():
    # Capacity is each rank's, over its own tokens, as at ep = 1: the same slots are dropped as in the reference,
    # which routes each rank's share on its own (tests/helpers/reference.py, per-rank balancing), so the runs agree
    # to 1e-12. (A capacity makes the drops depend on how the batch is cut, whatever the balancing: docs/moe.md.)
    ref = plain_run(_config(2, 0, capacity=0.5, balance="rank"), STEPS)
    ours = run_ranks(_ep_train, 2, 2, 0.5, "rank")[0][0]
    assert_close_to(ref, 1e-12, "MoE ep 2 with capacity 0.5", losses=ours["losses"], grad_norms=ours["grad_norms"],
                    params=ours["params"])
    assert all(step[0][E] > 0 for step in ours["load"])  # slots were dropped


def test_a_rank_that_sends_nothing_and_an_expert_that_gets_nothing_are_exact():
    # (A known bug of a peer doubled gradients at ep = 2 when a rank sent no tokens.) Each rank's output equals
    # its own computation without expert parallelism; the expert weights' gradients summed over the ranks equal
    # the sum of the ranks' own (what the data-parallel average then divides), expert 3's are zero.
    ranks = run_ranks(_layer_on_ranks, 2)
    assert ranks[1][1]["load"][2:] == [0.0, 0.0] and ranks[0][1]["load"][3] == 0.0
    assert min(ranks[0][1]["load"][:3]) > 0, ranks[0][1]["load"]  # both of rank 0's experts get rows from both
    for got in ranks:
        assert (got[2]["out"] - got[1]["out"]).abs().max() <= 1e-12
        assert (got[2]["grads"]["router.weight"] - got[1]["grads"]["router.weight"]).abs().max() <= 1e-12
    for name in ("up", "up_bias", "down", "down_bias"):
        with_ep = ranks[0][2]["grads"][name] + ranks[1][2]["grads"][name]
        without = ranks[0][1]["grads"][name] + ranks[1][1]["grads"][name]
        assert (with_ep - without).abs().max() <= 1e-12, name
        assert with_ep[3].abs().max() == 0


# --- a Hugging Face mixture of experts through the API -----------------------------------------------------------
def _mixtral_steps(model, optimizer, xs, rank, world):
    from tests.helpers.hf_models import lm_loss

    losses = []
    for x in xs:
        loss = lm_loss(model, x.chunk(world)[rank] if world else x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _mixtral_ranks(topo, ep, zero, kind="mixtral", plan="auto"):
    import minitrain

    from tests.helpers.hf_models import OPTIMIZERS, batches

    minitrain.init_distributed(topology=topo)
    model, optimizer = minitrain.prepare(tiny_moe(kind=kind), OPTIMIZERS["adamw"], zero=zero, ep=ep, ep_plan=plan)
    held = model.model.layers[0].mlp.experts.gate_up_proj.shape[0]  # this rank's experts
    losses = _mixtral_steps(model, optimizer, batches(3, 8), minitrain.dp_rank(), minitrain.dp_world_size())
    state = {k: v.clone() for k, v in minitrain.full_state_dict(model).items()}
    minitrain.cleanup()
    return losses, state, held


@pytest.mark.parametrize("kind,world,ep,zero,plan", [
    ("mixtral", 2, 2, 0, "auto"), ("mixtral", 2, 2, 3, "auto"), ("mixtral", 4, 4, 2, "auto"), ("olmoe", 2, 2, 1, "auto"),
    ("mixtral", 2, 2, 0, {"model.layers.*.mlp.experts": "experts"})])  # a plan of one's own naming the modules
def test_a_hugging_face_mixtral_with_expert_parallelism_trains_as_one_process_does(kind, world, ep, zero, plan):
    # ep_plan="auto" reads Mixtral's base_model_ep_plan: its experts modules (gate_up_proj (E, 2F, D), down_proj)
    # compute where their experts are. Against plain PyTorch on one process with Hugging Face's own forward and
    # torch.optim.AdamW on the whole batch, to 1e-12 in float64 (its balancing loss is off by default).
    from tests.helpers.hf_models import OPTIMIZERS, batches

    plain = tiny_moe(kind=kind)
    optimizer = OPTIMIZERS["adamw"](plain.parameters())
    from tests.helpers.hf_models import lm_loss

    shares = []  # each step's loss of each rank's share
    for x in batches(3, 8):  # the mean over the ranks' shares, as data parallelism averages them
        losses = [lm_loss(plain, share) for share in x.chunk(world)]
        (sum(losses) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
        shares.append([loss.item() for loss in losses])
    want = plain.state_dict()
    for rank, (losses, state, held) in enumerate(run_ranks(_mixtral_ranks, world, ep, zero, kind, plan)):
        assert held == 4 // ep  # each rank holds its share of the experts; full_state_dict gathers them whole
        assert max(abs(ours - step[rank]) for ours, step in zip(losses, shares)) <= 1e-12, (losses, shares)
        assert max((state[k] - want[k]).abs().max().item() for k in want) <= 1e-12


def _clipped_ranks(topo, zero):
    import minitrain

    from tests.helpers.hf_models import OPTIMIZERS, batches, lm_loss

    minitrain.init_distributed(topology=topo)
    model, optimizer = minitrain.prepare(tiny_moe(), OPTIMIZERS["adamw"], zero=zero, ep=2, ep_plan="auto")
    norms, shown = [], []
    for x in batches(3, 8):
        lm_loss(model, x.chunk(2)[minitrain.dp_rank()]).backward()
        norms.append(minitrain.clip_grad_norm_(model, 0.05))
        if zero <= 1:  # p.grad holds the step's gradient (ZeRO-2/3 keep only shards)
            shown.append(model.lm_head.weight.grad.clone())
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.clone() for k, v in minitrain.full_state_dict(model).items()}
    minitrain.cleanup()
    return norms, shown, state


def test_a_hugging_face_moe_at_ep_2_clips_by_the_global_norm_at_every_zero_stage():
    # The norm read by clip_grad_norm_ needs the gradient settled over the ep group (each rank's dense gradient
    # is of its own tokens); at ZeRO-0/1 p.grad shows that settled gradient, and the step after the clip uses it.
    from tests.helpers.hf_models import OPTIMIZERS, batches, lm_loss

    plain = tiny_moe()
    optimizer = OPTIMIZERS["adamw"](plain.parameters())
    norms, grads = [], []
    for x in batches(3, 8):
        (sum(lm_loss(plain, share) for share in x.chunk(2)) / 2).backward()
        grads.append(plain.lm_head.weight.grad.clone())
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)))
        optimizer.step()
        optimizer.zero_grad()
    assert min(norms) > 0.05  # every step clipped
    want = plain.state_dict()
    for zero in (0, 1, 2, 3):
        ours, shown, state = run_ranks(_clipped_ranks, 2, zero)[0]
        assert max(abs(a - b) for a, b in zip(ours, norms)) <= 1e-12, (zero, ours, norms)
        assert all((a - b).abs().max() <= 1e-12 for a, b in zip(shown, grads)), zero
        assert max((state[k] - want[k]).abs().max().item() for k in want) <= 1e-12, zero


def _refusals(topo):
    import minitrain

    from tests.helpers.hf_models import OPTIMIZERS, make_model

    minitrain.init_distributed(topology=topo)
    said = []
    for model, kwargs in ((make_model("llama"), {"ep": 2}), (tiny_moe(), {"ep": 2, "ep_plan": {"*.experts": "rowwise"}}),
                          (tiny_moe(), {"ep": 3, "ep_plan": "auto"}), (make_model("llama"), {"ep": 2, "ep_plan": "auto"}),
                          (tiny_moe(), {"ep": 2, "ep_plan": {"model.layers.*.nothing": "experts"}}),
                          (_model(), {"tp": 2, "tp_plan": {"blocks.*.attn.qkv": "colwise"}}),
                          (_model(), {"pp": 2, "pp_split": minitrain.PipelineSplit(["blocks"])})):
        said.append(refusal(lambda: minitrain.prepare(model, OPTIMIZERS["adamw"], **kwargs)))
    minitrain.cleanup()
    return said


def test_expert_parallelism_refuses_what_it_cannot_split_saying_why():
    said = run_ranks(_refusals, 2)[0]
    assert "has no MoE layer minitrain knows" in said[0]
    assert "ep_plan styles are 'experts'" in said[1]
    assert "ep=3 does not divide the world size 2" in said[2]
    assert "ships none (config.base_model_ep_plan names no experts)" in said[3]
    # A MiniGPT-MoE without ep: tensor and pipeline parallelism are refused too, saying why (docs/moe.md).
    assert "tp=2, pp=1 with MoEMLP, a mixture of experts" in said[5] and "balancing loss" in said[5]
    assert "tp=1, pp=2 with MoEMLP" in said[6]
    assert "ep_plan matches no module" in said[4]


def _save_at(topo, ep, out):
    from minitrain.train.trainer import Trainer

    cfg = _config(topo.world_size, 0)
    cfg.dist.ep, cfg.train.batch_size = ep, 8 // topo.world_size
    with Trainer(cfg, topo) as trainer:
        for _ in range(2):
            trainer.train_step()
        path = trainer.save_checkpoint(out)
        state = {k: _whole(trainer, v) for k, v in trainer.strategy.optimizer.state_tensors().items()}
        return str(path), _whole(trainer), state


def _load_at(topo, ep, zero, path):
    from minitrain.train.trainer import Trainer

    cfg = _config(topo.world_size, zero)
    cfg.dist.ep, cfg.train.batch_size = ep, 8 // topo.world_size
    with Trainer(cfg, topo) as trainer:
        trainer.load_checkpoint(path)
        s = trainer.strategy
        state = None if zero else {k: _whole(trainer, v) for k, v in s.optimizer.state_tensors().items()}
        return _whole(trainer), state, trainer.train_step().loss


def test_a_checkpoint_saved_at_ep_4_loads_at_ep_2(tmp_path):
    path, saved, _ = run_ranks(_save_at, 4, 4, str(tmp_path / "ckpt"))[0]
    two, _, _ = run_ranks(_load_at, 2, 2, 1, path)[0]
    assert torch.equal(two, saved)


def test_a_checkpoint_saved_at_ep_2_loads_at_ep_1_and_4_with_every_expert_in_its_place(tmp_path):
    # (Peers have renumbered experts per rank and loaded one rank's experts for all.) Saved by 2 ranks at ep = 2;
    # loaded by 1 rank at ep = 1 (ZeRO-0) and by 4 ranks at ep = 4 (ZeRO-3): the same parameters, every expert's
    # weights where they were, and at ep = 1 the same master, m and v; both then train on.
    path, saved, saved_state = run_ranks(_save_at, 2, 2, str(tmp_path / "ckpt"))[0]
    # Consolidated, the model's own keys and whole shapes: each layer's 4 experts, whichever rank held them.
    from minitrain import checkpoint

    whole = checkpoint.consolidated_state_dict(path)
    assert whole["blocks.0.mlp.up"].shape == (E, 128, 32) and whole["blocks.1.mlp.down_bias"].shape == (E, 32)
    one, one_state, one_loss = run_ranks(_load_at, 1, 1, 0, path)[0]
    four, _, four_loss = run_ranks(_load_at, 4, 4, 3, path)[0]
    assert torch.equal(one, saved) and torch.equal(four, saved)
    assert_bit_equal(one_state, saved_state, "optimizer state at ep 1")
    assert abs(one_loss - four_loss) <= 1e-12  # the next step, on either layout


def _held_at_ep(topo, ep):
    from minitrain.train.run_config import run_config
    from minitrain.train.trainer import Trainer

    held = {}
    for zero in (0, 1, 2, 3):
        cfg = run_config(cli_values={"model.moe_experts": E, "model.moe_top_k": K, "train.zero": zero,
                                     "dist.nproc": topo.world_size, "dist.ep": ep, "train.log_every": 0})
        with Trainer(cfg, topo) as trainer:
            trainer.train_step()
            held[zero] = trainer.strategy.memory_bytes()
    return held, cfg.model


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_the_plan_predicts_the_bytes_each_rank_holds_under_expert_parallelism(world, ep):
    # As for ZeRO: the planner's bytes at rest per rank are what the strategy holds, at every stage, with 1/ep of
    # the experts and ZeRO sharding over the experts' replicas (world / ep ranks).
    from minitrain import plan

    held, model = run_ranks(_held_at_ep, world, ep)[0]
    for zero, measured in held.items():
        predicted = plan.model_state_bytes(plan.PlanInput(model=model, params=0, dp=world, ep=ep, zero=zero))
        assert predicted == {k: measured[k] for k in predicted}, (zero, predicted, measured)


def _mixtral_save(topo, out):
    import minitrain

    from tests.helpers.hf_models import OPTIMIZERS, batches

    minitrain.init_distributed(topology=topo)
    model, optimizer = minitrain.prepare(tiny_moe(), OPTIMIZERS["adamw"], zero=1, ep=2, ep_plan="auto")
    _mixtral_steps(model, optimizer, batches(2, 8), minitrain.dp_rank(), minitrain.dp_world_size())
    minitrain.save_checkpoint(out, model, optimizer, step=2)
    state = {k: v.clone() for k, v in minitrain.full_state_dict(model).items()}
    opt_state = optimizer.state_dict()
    minitrain.cleanup()
    return state, opt_state


def _mixtral_load(topo, out):
    import minitrain

    from tests.helpers.hf_models import OPTIMIZERS

    minitrain.init_distributed(topology=topo)
    model, optimizer = minitrain.prepare(tiny_moe(seed=5), OPTIMIZERS["adamw"])
    step, _ = minitrain.load_checkpoint(out, model, optimizer)
    state = {k: v.clone() for k, v in minitrain.full_state_dict(model).items()}
    opt_state = optimizer.state_dict()
    minitrain.cleanup()
    return step, state, opt_state


def test_a_mixtral_saved_with_its_experts_split_loads_whole_on_one_rank(tmp_path):
    # Saved through the API at ep = 2 (each rank holding 2 of the 4 experts, ZeRO-1), loaded on one rank without
    # expert parallelism into a model of other weights: every expert's weights and Adam state where they were.
    saved, saved_opt = run_ranks(_mixtral_save, 2, str(tmp_path / "ckpt"))[0]
    step, loaded, loaded_opt = run_ranks(_mixtral_load, 1, str(tmp_path / "ckpt"))[0]
    assert step == 2 and saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert_bit_equal(loaded_opt["state"], saved_opt["state"], "Adam state")


def _collectives(topo, ep, balance, recompute):
    """(all_to_all calls and bytes on the ep group, all_reduce calls on the ranks that split the batch) over
    STEPS steps."""
    from minitrain.train.trainer import Trainer

    cfg = _config(topo.world_size, 0, balance=balance)
    cfg.dist.ep, cfg.train.activation_checkpointing = ep, recompute
    with Trainer(cfg, topo) as trainer:
        for _ in range(STEPS):
            trainer.train_step()
        t = trainer.topo
        a2a = t.ep.stats.get("all_to_all")
        reduces = t.data.stats.get("all_reduce")
        return ((a2a.calls, a2a.bytes) if a2a else (0, 0)), (reduces.calls if reduces else 0), cfg.model


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_the_plan_counts_the_all_to_alls_and_the_balance_all_reduces_a_step_sends(recompute):
    from minitrain import plan

    (a2a, reduces, model), = run_ranks(_collectives, 2, 2, "global", recompute)[:1]
    _, reduces_rank, _ = run_ranks(_collectives, 2, 2, "rank", recompute)[0]
    rows = {r["what"]: r for r in plan.plan(plan.PlanInput(model=model, params=0, micro_batch=2, dp=2, ep=2,
                                                           activation_checkpointing=recompute))["communication"]}
    counts, routed = rows["expert all_to_all (row counts)"], rows["expert all_to_all (routed rows)"]
    assert a2a[0] == STEPS * (counts["calls"] + routed["calls"])
    # The counts' bytes are exact; the rows' are what the router sent (half of them leave at ep 2 when even).
    assert a2a[1] >= STEPS * counts["bytes"] / 0.5
    assert reduces - reduces_rank == STEPS * rows["MoE balance all_reduce (expert counts)"]["calls"]
    assert "MoE balance all_reduce (expert counts)" not in {
        r["what"] for r in plan.plan(plan.PlanInput(model=dataclasses.replace(model, moe_balance="rank"), params=0,
                                                    micro_batch=2, dp=2, ep=2))["communication"]}
