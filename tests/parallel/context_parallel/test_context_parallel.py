"""MiniGPT trained with its sequences split over a context-parallel group (--dist.cp), ring or Ulysses attention,
against one process on the whole batch (tests/helpers/reference.py: plain PyTorch, float64): losses, gradient
norms and parameters to 1e-12, alone and with data parallelism and ZeRO; the settings it refuses, in one line."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_cli, run_ranks
from tests.helpers.reference import assert_close_to, plain_run

STEPS = 3


def _config(world: int, cp: int, style: str, zero: int = 0, **more):
    from minitrain.train.run_config import run_config

    return run_config(cli_values={
        "model.preset": "tiny", "train.dtype": "float64", "train.steps": STEPS, "train.batch_size": 2,
        "train.zero": zero, "train.lr": 1e-2, "train.log_every": 0, "train.grad_clip": 1.0, "dist.nproc": world,
        "dist.cp": cp, "dist.cp_style": style, **more})


def _train(topo, cp, style, zeros, more):
    from minitrain.train.trainer import Trainer

    got = {}
    for zero in zeros:
        with Trainer(_config(topo.world_size, cp, style, zero, **more), topo) as trainer:
            records = [trainer.train_step() for _ in range(STEPS)]
            got[zero] = {"losses": [r.loss for r in records], "grad_norms": [r.grad_norm for r in records],
                         "params": trainer.strategy.full_params(), "tokens": records[-1].tokens}
    return got


@pytest.mark.parametrize("world,cp,style,zeros", [
    (2, 2, "ring", (0, 3)), (4, 4, "ring", (0,)), (2, 2, "ulysses", (0, 3)), (4, 4, "ulysses", (0,)),
    (4, 2, "ring", (0, 2)), (4, 2, "ulysses", (1,))])
def test_context_parallel_trains_as_one_process_does(world, cp, style, zeros):
    # world / cp data-parallel replicas each read their own sequences; every rank of a context group the same
    # ones, cut into its two chunks. The reference: one process on the whole global batch.
    ref = plain_run(_config(world, cp, style), STEPS)
    got = run_ranks(_train, world, cp, style, zeros, {})
    for zero in zeros:
        ours = got[0][zero]
        assert_close_to(ref, 1e-12, f"cp {cp} ({style}) at {world} ranks, ZeRO-{zero}", losses=ours["losses"],
                        grad_norms=ours["grad_norms"], params=ours["params"])
        assert ours["tokens"] == 2 * 16 * (world // cp)  # the step's tokens: each sequence counted once


def test_bad_context_settings_are_refused_in_one_line(tmp_path):
    for flags, message in (
            (["--nproc", "2", "--dist.cp", "2", "--model.seq_len", "18"], "does not divide by 4"),
            (["--nproc", "4", "--dist.cp", "4", "--dist.cp_style", "ulysses", "--model.n_head", "2",
              "--model.d_model", "32"], "does not divide them"),
            (["--nproc", "4", "--dist.cp", "2", "--tp", "2"], "composes with data parallelism and ZeRO only"),
            (["--nproc", "3", "--dist.cp", "2"], "does not divide the 3 ranks"),
            (["--nproc", "2", "--dist.cp", "2", "--dist.cp_style", "tree"], "cp_style")):
        proc = run_cli("train", "--steps", "1", "--out", str(tmp_path / "run"), *flags)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def _save_at_cp(topo, cp, out):
    from minitrain.train.trainer import Trainer

    with Trainer(_config(topo.world_size, cp, "ring", zero=1), topo) as trainer:
        for _ in range(2):
            trainer.train_step()
        return str(trainer.save_checkpoint(out)), trainer.strategy.full_params()


def _load_at_cp(topo, cp, zero, path):
    from minitrain.train.trainer import Trainer

    with Trainer(_config(topo.world_size, cp, "ulysses" if cp == 4 else "ring", zero=zero), topo) as trainer:
        trainer.load_checkpoint(path)
        return trainer.strategy.full_params(), trainer.train_step().loss


def test_a_checkpoint_saved_at_cp_2_loads_at_cp_1_and_4_and_trains_on_as_one_process(tmp_path):
    # Every rank of a context group holds the whole model: saved by 2 ranks at cp 2 (ZeRO-1, the optimizer state
    # sharded over both), loaded by one rank without cp and by 4 at cp 4 (ZeRO-3): the same parameters, bit for
    # bit, and the third step equal to one process's, which never stopped.
    path, saved = run_ranks(_save_at_cp, 2, 2, str(tmp_path / "ckpt"))[0]
    ref = plain_run(_config(1, 1, "ring"), STEPS)
    for world, zero in ((1, 0), (4, 3)):
        loaded, loss = run_ranks(_load_at_cp, world, world, zero, path)[0]
        assert torch.equal(loaded, saved), world
        assert abs(loss - ref.losses[2]) <= 1e-12, (world, loss, ref.losses[2])


def _sent(topo, style, recompute):
    from minitrain.train.trainer import Trainer

    cfg = _config(topo.world_size, topo.world_size, style, **{"train.activation_checkpointing": recompute,
                                                             "train.dtype": "float32"})
    with Trainer(cfg, topo) as trainer:
        for _ in range(STEPS):
            trainer.train_step()
        return {op: (s.calls, s.bytes) for op, s in trainer.topo.cp.stats.items()}, cfg.model


@pytest.mark.parametrize("style,recompute", [("ring", "none"), ("ring", "block"), ("ulysses", "none")])
def test_the_plan_counts_the_transfers_context_parallelism_sends(style, recompute):
    from minitrain import plan

    sent, model = run_ranks(_sent, 2, style, recompute)[0]
    rows = plan.plan(plan.PlanInput(model=model, params=0, micro_batch=2, cp=2, cp_style=style,
                                    activation_checkpointing=recompute))["communication"]
    mine = [r for r in rows if r["what"].startswith(("ring", "Ulysses"))]
    calls, nbytes = sent["send" if style == "ring" else "all_to_all"]
    assert calls == STEPS * sum(r["calls"] for r in mine), (sent, mine)
    factor = 1.0 if style == "ring" else 1 / 2  # what leaves the rank of what the collective is handed
    assert nbytes * factor == STEPS * sum(r["bytes"] for r in mine), (sent, mine)
