"""Where a step's time goes (step_timer.py), and --train.profile_steps traces."""
import json

import pytest


from minitrain.train.run_config import run_config
from minitrain.train.step_timer import PHASES
from minitrain.runtime.topology import Topology
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_cli, run_main, run_ranks


def _phases(topo, extra):
    cfg = run_config(cli_values={"dist.nproc": topo.world_size, "train.log_every": 0, **extra})
    trainer = Trainer(cfg, topo)
    return [trainer.train_step() for _ in range(3)]


def _check_partition(record):
    phases = record.phases_s
    assert set(phases) == set(PHASES)
    measured = [v for v in phases.values() if v is not None]
    assert all(v >= 0 for v in measured)
    assert abs(sum(measured) - record.step_time_s) < 1e-9  # "other" is the rest of the step


def test_one_process_step_splits_into_its_phases():
    # The small preset: a backward of tens of milliseconds, which no preemption of the data phase by a process beside
    # this one (a timeslice of a few milliseconds) outlasts; the tiny model's took about one.
    records = _phases(Topology.single(), {"model.preset": "small"})
    for record in records:
        _check_partition(record)
        p = record.phases_s
        assert p["forward_backward"] is None and min(p["data"], p["forward"], p["backward"], p["optimizer"]) > 0
    # Summed over the steps after the first, whose data phase waits for the prefetch thread's first batch (made
    # while nothing runs beside it).
    assert sum(r.phases_s["backward"] for r in records[1:]) > sum(r.phases_s["data"] for r in records[1:])


def test_a_pipelined_step_reports_its_passes_as_one_phase():
    for record in _phases(Topology.single(), {"dist.microbatches": 2}):
        _check_partition(record)
        assert record.phases_s["forward"] is None and record.phases_s["backward"] is None
        assert record.phases_s["forward_backward"] > 0


@pytest.mark.parametrize("zero", [1, 3])
def test_exposed_communication_is_its_own_phase(zero):
    for record in run_ranks(_phases, 2, {"train.zero": zero})[0]:
        _check_partition(record)
        # The gradient sync's wait and the update's collectives (the norm, ZeRO's parameter gathers).
        assert record.phases_s["comm"] > 0


def test_profile_steps_writes_one_trace_per_rank(tmp_path):
    result = run_cli("train", "--nproc", "2", "--steps", "4", "--train.profile_steps", "2:3", "--out", "run",
                     cwd=tmp_path, timeout_s=120)
    assert result.returncode == 0, result.stderr
    assert "profiler traces (one per rank): run/profile" in result.stdout
    assert "where a step went (rank 0, after warmup): data " in result.stdout
    for rank in (0, 1):
        (trace,) = (tmp_path / "run" / "profile").glob(f"rank{rank}.*.pt.trace.json")
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert "aten::addmm" in names and "aten::_fused_adamw_" in names


@pytest.mark.parametrize("value,message", [
    ("3", "train.profile_steps must look like A:B (e.g. 5:7), got '3'"),
    ("0:2", "train.profile_steps '0:2' must satisfy 1 <= A <= B <= train.steps (20)"),
    ("5:99", "train.profile_steps '5:99' must satisfy 1 <= A <= B <= train.steps (20)"),
])
def test_bad_profile_steps_exit_2_with_one_line(value, message):
    result = run_main("train", "--train.profile_steps", value)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
