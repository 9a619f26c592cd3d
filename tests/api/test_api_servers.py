"""prepare(model, optimizer_fn, servers=S, staleness=K): the user's loop on workers, the user's optimizer on
servers. At K = 0 a Hugging Face model trains exactly as data parallel does (bit for bit) and as plain PyTorch on
the whole batch (to 1e-10), with param groups, a learning-rate scheduler and clipping; under K > 0 every worker
ends on the last update."""
from __future__ import annotations

import pytest
import torch

import minitrain

from tests.helpers.dist import run_ranks
from tests.helpers.hf_models import OPTIMIZERS, batches, lm_loss, make_model, param_groups

pytestmark = pytest.mark.slow

STEPS, MAX_NORM = 4, 0.5


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def _decay(step: int) -> float:
    return 0.5 ** step


SCHEDULES = [_warmup, _decay]  # one per param group: each group's learning rate must reach its own servers' group


def _hugging_face_loop(topo, servers: int) -> dict | None:
    """The same loop with parameter servers (servers=1) or as data parallel (servers=0): a tied Llama, AdamW over
    two param groups, a warm-up schedule, clipping at every step."""
    minitrain.init_distributed(topology=topo)
    model = make_model("llama-tied")
    model, optimizer = minitrain.prepare(model, OPTIMIZERS["adamw"], param_groups=param_groups(model),
                                         servers=servers)
    if minitrain.is_server():
        with pytest.raises(RuntimeError, match="parameter server"):
            optimizer.step()
        served = minitrain.serve()
        minitrain.cleanup()
        return {"served": served}
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, SCHEDULES)
    rank, world = minitrain.dp_rank(), minitrain.dp_world_size()
    losses, norms = [], []
    for x in batches(STEPS, 8):
        loss = lm_loss(model, x.chunk(world)[rank])
        loss.backward()
        norms.append(minitrain.clip_grad_norm_(model, MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
    refused = []
    for call in (lambda: minitrain.save_checkpoint("/nonexistent", model, optimizer, 1), optimizer.state_dict):
        try:
            call()
        except ValueError as e:
            refused.append(str(e))
    state = minitrain.full_state_dict(model)
    minitrain.cleanup()
    return {"losses": losses, "norms": norms, "state": state, "refused": refused, "world": world}


def _plain_pytorch() -> dict:
    model = make_model("llama-tied")
    optimizer = OPTIMIZERS["adamw"](param_groups(model))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, SCHEDULES)
    norms = []
    for x in batches(STEPS, 8):
        lm_loss(model, x).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return {"norms": norms, "state": model.state_dict()}


def test_a_hugging_face_model_on_servers_trains_as_data_parallel_bit_for_bit():
    first, second, server = run_ranks(_hugging_face_loop, 3, 1, timeout_s=120)
    [dp, _] = run_ranks(_hugging_face_loop, 2, 0, timeout_s=120)
    assert first["world"] == second["world"] == 2  # dp_rank() / dp_world_size() count the workers
    assert first["norms"] == dp["norms"] and min(dp["norms"]) > MAX_NORM  # clipping engaged, the same norm
    for worker in (first, second):
        assert worker["state"].keys() == dp["state"].keys()
        assert all(torch.equal(worker["state"][k], dp["state"][k]) for k in dp["state"])
        assert [m.split(" with ")[0] for m in worker["refused"]] == ["save_checkpoint", "optimizer.state_dict()"]
    assert server["served"]["updates"] == STEPS
    plain = _plain_pytorch()
    assert max(abs(a - b) for a, b in zip(first["norms"], plain["norms"])) <= 1e-10
    for key, value in plain["state"].items():
        assert (first["state"][key] - value).abs().max().item() <= 1e-10, key


def _stale_loop(topo) -> dict | None:
    """Two workers at K = 1, worker 1 slower: each may compute on parameters one update old."""
    import time

    minitrain.init_distributed(topology=topo)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    model, optimizer = minitrain.prepare(model, OPTIMIZERS["sgd"], servers=1, staleness=1)
    if minitrain.is_server():
        served = minitrain.serve()
        minitrain.cleanup()
        return {"served": served}
    g = torch.Generator().manual_seed(minitrain.dp_rank())
    refused = []
    for step in range(6):
        if minitrain.dp_rank() == 1:
            time.sleep(0.05)
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        model(x).pow(2).mean().backward()
        if step == 0:  # an option other than the learning rate cannot follow to the servers: refused
            optimizer.param_groups[0]["momentum"] = 0.5
            with pytest.raises(ValueError, match="momentum changed since prepare") as e:
                optimizer.step()
            refused.append(str(e.value))
            optimizer.param_groups[0]["momentum"] = 0.9
        minitrain.clip_grad_norm_(model, 10.0)
        if step == 1:  # it pushes: a second call would be a second update
            with pytest.raises(RuntimeError, match="called already this step"):
                minitrain.clip_grad_norm_(model, 10.0)
        optimizer.step()
        optimizer.zero_grad()
    minitrain.cleanup()  # waits for the last update: every worker ends on it
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]), "refused": refused}


def test_under_bounded_staleness_every_worker_ends_on_the_last_update():
    fast, slow, server = run_ranks(_stale_loop, 3, timeout_s=60)
    assert torch.equal(fast["params"], slow["params"])
    served = server["served"]
    # Staleness happened (the fast worker ran a step ahead) and stayed within K.
    assert served["updates"] == 6 and sorted(served["staleness_counts"]) == ["0", "1"]
    assert fast["refused"] == slow["refused"] != []


@pytest.mark.parametrize("kwargs, message", [
    ({"servers": 1, "zero": 1}, "does not combine with zero=1"),
    ({"servers": 1, "offload": "cpu"}, "does not combine with offload='cpu'"),
    ({"staleness": 1}, "staleness needs parameter servers"),
    ({"servers": -1}, "servers must be a non-negative integer"),
    ({"servers": 2}, "leaves no worker in a world of 2"),
])
def test_refused_server_settings_say_what_to_fix(kwargs, message):
    from minitrain.api.servers import check_server_settings

    given = {"zero": 0, "tp": 1, "pp": 1, "ep": 1, "offload": "none", "dp": "bucketed"}
    given.update({k: v for k, v in kwargs.items() if k in given})
    with pytest.raises(ValueError, match=message):
        check_server_settings(kwargs.get("servers", 0), kwargs.get("staleness", 0), 2, "gloo", "fp32", given)
