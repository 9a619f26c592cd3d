"""Late statistics (--train.late_stats): each step's statistics read while the next step runs, so the host never
waits for the device between steps. The same numbers, one step later: records, skipped steps, the optimizer's
step count, evaluations, checkpoints and a loss-spike rollback all equal reading every step at once. On the CPU
the mode is forced on (auto turns it on on a GPU only; tests/system/test_gpu.py checks there that a late step makes
no host synchronisation)."""
from __future__ import annotations

import functools
import json
import statistics

import pytest

from minitrain.config import ConfigError
from minitrain.parallel.core.sync_stats import same_state
from minitrain.runtime.topology import Topology
from minitrain.train.loop import TrainingRun
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_ranks

STEPS, BAD = 6, 3  # BAD: the 1-based step whose loss (so its gradients) is NaN
# What a record holds that does not depend on when it was read (times do).
SAME = ("step", "loss", "grad_norm", "param_norm", "lr", "tokens_seen", "skipped", "comm_calls", "comm_bytes",
        "param_norm_per_rank", "memory")


def _steps(topo, late: str, zero: int) -> dict:
    cfg = run_config(cli_values={"model.preset": "tiny", "train.dtype": "float64", "train.zero": zero,
                                 "dist.nproc": topo.world_size, "train.steps": STEPS, "train.log_every": 0,
                                 "train.lr": 1e-2, "train.late_stats": late})
    with Trainer(cfg, topo) as trainer:
        records, returned = [], []
        for step in range(1, STEPS + 1):
            poison = (trainer.model.head.register_forward_hook(lambda _m, _a, out: out * float("nan"))
                      if step == BAD and topo.rank == topo.world_size - 1 else None)
            record = trainer.launch_step()
            if poison is not None:
                poison.remove()
            returned.append(None if record is None else record.step)
            records += [record] if record is not None else []
        if trainer.late_stats:
            with pytest.raises(RuntimeError, match="call settle"):  # reading this step first would lose the last
                trainer.train_step()
        last = trainer.settle()
        return {"records": [{k: getattr(r, k) for k in SAME} for r in records + [last] if r is not None],
                "times": [r.step_time_s for r in records + [last] if r is not None],
                "returned": returned, "last": None if last is None else last.step, "late": trainer.late_stats,
                "state": trainer.strategy.state_snapshot(), "steps_taken": trainer.strategy.optimizer.steps_taken}


@pytest.mark.parametrize("world,zero", [(1, 0), (1, 3), (2, 2)])
def test_late_statistics_are_the_read_at_once_ones_a_step_later(world, zero):
    results = {}
    for late in ("off", "on"):
        run = functools.partial(_steps, late=late, zero=zero)
        results[late] = run(Topology.single()) if world == 1 else run_ranks(run, world)[0]
    off, on = results["off"], results["on"]
    assert (off["late"], on["late"]) == (False, True)
    assert off["returned"] == list(range(1, STEPS + 1)) and off["last"] is None
    assert on["returned"] == [None] + list(range(1, STEPS)) and on["last"] == STEPS  # the step before's; settle()
    assert json.dumps(on["records"]) == json.dumps(off["records"])  # the same figures to the bit, NaN step included
    assert [r["skipped"] for r in on["records"]] == [s == BAD for s in range(1, STEPS + 1)]
    # Each step's own time, also for the one read at once by settle() (not the interval since the last read).
    assert min(on["times"]) >= 0.2 * statistics.median(on["times"]), on["times"]
    # The fused kernel takes a skipped step back from its own count: no host read decides it.
    assert on["steps_taken"] == off["steps_taken"] == STEPS - 1
    assert same_state(on["state"], off["state"])


def _run(out, late: str, **values):
    base = {"train.steps": 16, "ckpt.every_steps": 5, "train.log_every": 0, "eval.every": 3, "out": str(out),
            "train.late_stats": late}
    run = TrainingRun(Topology.single(), run_config(cli_values={**base, **values}))
    return run, run.run()


def _lines(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_with_late_statistics_logs_evaluates_saves_and_rolls_back_as_one_without(tmp_path):
    # Step 12's learning rate x 1000: step 13's loss spikes and the run rolls back to step 10, in both modes.
    spike = {"fault.kind": "lr-spike", "fault.step": 12, "fault.lr_multiplier": 1000.0}
    runs = {late: _run(tmp_path / late, late, **spike) for late in ("off", "on")}
    (off, off_summary), (on, on_summary) = runs["off"], runs["on"]
    assert on.trainer.late_stats and not off.trainer.late_stats
    assert on_summary["rollbacks"] == off_summary["rollbacks"] and on_summary["rollbacks"][0]["to_step"] == 10
    keep = ("step", "event", "loss", "grad_norm", "val_loss", "tokens_seen", "skipped")
    assert ([{k: line.get(k) for k in keep} for line in _lines(tmp_path / "on")] ==
            [{k: line.get(k) for k in keep} for line in _lines(tmp_path / "off")])
    assert [line.get("val_loss") is not None for line in _lines(tmp_path / "on") if "event" not in line] == [
        s % 3 == 0 or s == 16 for s in [*range(1, 11), *range(11, 17)]]
    assert sorted(p.name for p in (tmp_path / "on" / "checkpoints").iterdir()) == sorted(
        p.name for p in (tmp_path / "off" / "checkpoints").iterdir())
    assert same_state(on.trainer.strategy.state_snapshot(), off.trainer.strategy.state_snapshot())


def test_stop_at_and_resume_with_late_statistics_are_bit_identical(tmp_path):
    whole, _ = _run(tmp_path / "whole", "off", **{"eval.every": 0})
    stopped, summary = _run(tmp_path / "parts", "on", **{"eval.every": 0, "train.stop_at": 7})
    assert summary["steps"] == 7 and stopped.trainer.step == 7  # stopped at 7 itself, not a step late
    resumed, _ = _run(tmp_path / "parts", "on", **{"eval.every": 0, "ckpt.resume": "auto"})
    assert same_state(resumed.trainer.strategy.state_snapshot(), whole.trainer.strategy.state_snapshot())
    losses = {name: [line["loss"] for line in _lines(tmp_path / name)] for name in ("parts", "whole")}
    assert losses["parts"] == losses["whole"]


@pytest.mark.parametrize("values", [{"train.precision": "fp16"}, {"dist.pp": 2, "dist.nproc": 2},
                                    {"dist.microbatches": 2}])
def test_late_statistics_on_where_a_step_needs_the_last_ones_is_refused(values):
    with pytest.raises(ConfigError, match="late_stats on"):
        run_config(cli_values={"train.late_stats": "on", **values})
    assert run_config(cli_values={"train.late_stats": "auto", **values}).train.late_stats == "auto"


def test_auto_reads_late_on_a_gpu_only():
    cfg = run_config(cli_values={"model.preset": "tiny", "train.log_every": 0})
    with Trainer(cfg, Topology.single()) as trainer:
        assert cfg.train.late_stats == "auto" and not trainer.late_stats  # the CPU: nothing to overlap
