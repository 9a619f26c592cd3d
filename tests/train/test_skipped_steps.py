"""A skipped step (its gradients NaN/Inf on some rank) changes nothing a later step reads: parameters, every
optimizer moment, every step counter (the one Adam's bias correction reads, on every path), and of the fp16 loss
scaler only what a skip is meant to change (the scale halves, the clean-step count restarts). The next taken
step then equals single-process float64 training that never saw the bad batch. Both for the CLI's trainer (its
update decided on the device, PyTorch's fused kernel told found_inf) and through minitrain.prepare with the
user's torch optimizer, at every ZeRO stage, on 2 ranks."""
from __future__ import annotations

import functools
import math

import torch

from tests.helpers.dist import run_ranks
from tests.helpers.numerics import assert_bit_equal, assert_states_match
from tests.helpers.reference import plain_run

STAGES = (0, 1, 2, 3)
BAD = 2  # the 0-based step whose batch turns NaN on rank 1
STEPS = 5
TOL = 1e-12


def _cli_config(world: int, zero: int, precision: str = "fp32"):
    from minitrain.train.run_config import run_config

    return run_config(cli_values={
        "train.zero": zero, "dist.nproc": world, "train.steps": STEPS, "train.lr": 1e-2, "train.log_every": 0,
        "train.dtype": "float64" if precision == "fp32" else "float32", "train.precision": precision,
        "train.grad_clip": 1.5, "train.max_skipped_steps": 3})


def _trainer_state(trainer) -> dict:
    """Everything of a trainer a later step reads, copied."""
    strategy = trainer.strategy
    tensors = strategy.state_snapshot()
    if strategy.stage < 3:  # the model's own parameters, read as a user would: whole between steps (ZeRO-2's too)
        tensors["model"] = torch.cat([p.detach().reshape(-1).clone() for p in trainer.model.parameters()])
    return {"tensors": tensors, "scalars": dict(strategy.optimizer.scalar_state()),
            "scaler": trainer.loss_scaler.state() if trainer.loss_scaler else None}


def _poison(model, rank: int):
    """On rank 1, the model's output (so its loss and gradients) turns NaN until the handle is removed."""
    if rank != 1:
        return None
    return model.register_forward_hook(lambda _m, _args, out: out * float("nan"))


def _cli(topo, zero: int, precision: str) -> dict:
    from minitrain.train.trainer import Trainer

    with Trainer(_cli_config(topo.world_size, zero, precision), topo) as trainer:
        records = [trainer.train_step() for _ in range(BAD)]
        before = _trainer_state(trainer)
        poison = _poison(trainer.model.head, topo.rank)
        records.append(trainer.train_step())
        if poison is not None:
            poison.remove()
        after = _trainer_state(trainer)
        records += [trainer.train_step() for _ in range(STEPS - BAD - 1)]
        return {"before": before, "after": after, "skipped": [r.skipped for r in records],
                "losses": [r.loss for r in records], "params": trainer.strategy.full_params()}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64))
            for _ in range(STEPS)]


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _api(topo, zero: int) -> dict:
    import minitrain
    from minitrain.api.session import state_of

    minitrain.init_distributed(topology=topo)
    model, optimizer = minitrain.prepare(_mlp(), ADAMW, zero=zero)
    counted = state_of(model).strategy.optimizer.scalar_state  # the step count a checkpoint records
    rank, world = minitrain.dp_rank(), minitrain.dp_world_size()
    out = {}
    for step, (x, y) in enumerate(_batches()):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        if step == BAD:
            out["before"] = (optimizer.state_dict(), minitrain.full_state_dict(model), counted())
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == BAD and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        out.setdefault("norms", []).append(minitrain.clip_grad_norm_(model, 1.0))
        optimizer.step()
        optimizer.zero_grad()
        if step == BAD:
            out["after"] = (optimizer.state_dict(), minitrain.full_state_dict(model), counted())
    out["final"] = (optimizer.state_dict(), minitrain.full_state_dict(model), counted())
    return out


def _every_case(topo) -> dict:
    cli = {(zero, precision): _cli(topo, zero, precision) for zero in STAGES for precision in ("fp32", "fp16")}
    api = {zero: _api(topo, zero) for zero in STAGES}
    import minitrain

    minitrain.cleanup()
    return {"cli": cli, "api": api}


def _plain_api() -> tuple[dict, dict]:
    """The API case's model, trained in one process on the whole batches, the bad one never seen."""
    model = _mlp()
    optimizer = ADAMW(model.parameters())
    for step, (x, y) in enumerate(_batches()):
        if step == BAD:
            continue
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return optimizer.state_dict(), model.state_dict()


def _close(a, b, where: str) -> None:
    """Two torch-format state dicts (or plain tensors) equal within TOL, key by key."""
    assert_states_match(a, b, where, TOL)


def test_a_skipped_step_changes_nothing_later_steps_read_and_training_goes_on_as_if_unseen():
    ranks = run_ranks(_every_case, 2)
    ref = plain_run(_cli_config(2, 0), STEPS, never_seen=frozenset({BAD}))
    for out in ranks:
        for (zero, precision), got in out["cli"].items():
            where = f"trainer ZeRO-{zero} {precision}"
            assert got["skipped"] == [s == BAD for s in range(STEPS)], where
            assert_bit_equal(got["after"]["tensors"], got["before"]["tensors"], f"{where}: parameters and moments")
            assert_bit_equal(got["after"]["scalars"], got["before"]["scalars"], f"{where}: optimizer step counters")
            if precision == "fp16":  # what a skip is meant to change, and only that
                assert got["after"]["scaler"] == {"scale": got["before"]["scaler"]["scale"] / 2, "clean_steps": 0}
                continue
            assert got["before"]["scalars"]["steps_taken"] == BAD, where
            losses = [loss for step, loss in enumerate(got["losses"]) if step != BAD]
            assert max(abs(a - b) for a, b in zip(losses, ref.losses)) <= TOL, f"{where}: losses"
            assert (got["params"] - ref.params).abs().max().item() <= TOL, f"{where}: parameters after the skip"
        plain_optimizer, plain_model = _plain_api()
        for zero, got in out["api"].items():
            where = f"prepare ZeRO-{zero}"
            assert math.isnan(got["norms"][BAD]) and all(math.isfinite(n) for i, n in enumerate(got["norms"]) if i != BAD)
            assert_bit_equal(got["after"], got["before"], f"{where}: optimizer state_dict and model across the skip")
            optimizer_state, model_state, steps = got["final"]
            assert got["before"][2]["steps_taken"] == BAD and steps["steps_taken"] == STEPS - 1, where
            _close(optimizer_state["state"], plain_optimizer["state"], f"{where}: optimizer state")
            _close(model_state, plain_model, f"{where}: parameters")
