"""Checkpoint cadence and retention, and --resume auto falling back past a corrupt checkpoint."""
from pathlib import Path

import pytest

from minitrain import checkpoint

from minitrain.train.loop import TrainingRun
from minitrain.train.run_config import run_config

from tests.helpers.dist import run_cli, run_main, run_ranks

pytestmark = pytest.mark.slow


def _train(out, *extra):
    proc = run_cli("train", "--nproc", "2", "--zero", "2", "--train.log_every", "0", "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    return proc


def _steps(out):
    return sorted(d.name for d in (out / "checkpoints").glob("step-*"))


def test_keep_last_keeps_the_newest_and_stale_temporaries_are_swept(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / ".tmp-step-000099").mkdir(parents=True)  # a crashed save's leftovers
    _train(out, "--steps", "5", "--ckpt-every-steps", "1", "--keep-last", "2")
    assert _steps(out) == ["step-000004", "step-000005"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000005"
    assert not list((out / "checkpoints").glob(".tmp-*"))


def _clock_runs(topo, root: str) -> dict:
    """Four steps under each save clock; per run, the steps saved and the collectives the run made."""
    found = {}
    for name, minutes, late in (("each", 1e-6, "off"), ("each-late", 1e-6, "on"), ("never", 60.0, "off"),
                                ("off", 0.0, "off")):
        values = {"train.steps": 4, "train.log_every": 0, "train.zero": 2, "dist.nproc": topo.world_size,
                  "ckpt.every_minutes": minutes, "ckpt.final_save": True, "train.late_stats": late,
                  "out": f"{root}/{name}"}
        before = topo.everyone.totals().calls
        TrainingRun(topo, run_config(cli_values=values)).run()
        found[name] = (_steps(Path(root) / name), topo.everyone.totals().calls - before)
    return found


def test_every_minutes_saves_by_rank_0s_clock_with_no_collective_of_its_own(tmp_path):
    found = run_ranks(_clock_runs, 2, str(tmp_path))[0]
    assert found["each"][0] == ["step-000001", "step-000002", "step-000003", "step-000004"]  # due after every step
    # Read late, step 1's reading comes with step 2; the reading taken before step 2's save counts no more at step 3.
    assert found["each-late"][0] == ["step-000002", "step-000004"]
    assert found["never"][0] == found["off"][0] == ["step-000004"]  # never due: only the final save
    # The clock travels in the step's statistics exchange: not one collective more than a run without it.
    assert found["never"][1] == found["off"][1], found


def test_the_every_minutes_flag_reaches_the_run(tmp_path):
    out = tmp_path / "run"
    _train(out, "--steps", "2", "--ckpt-every-minutes", "1e-6")
    assert _steps(out) == ["step-000001", "step-000002"]


def test_resume_auto_skips_a_corrupt_checkpoint_naming_the_file(tmp_path):
    out = tmp_path / "run"
    _train(out, "--steps", "4", "--ckpt-every-steps", "2")
    shard = out / "checkpoints" / "step-000004" / "rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed = _train(out, "--steps", "6", "--resume", "auto", "--ckpt-every-steps", "2")
    assert "skipping step-000004" in resumed.stderr and "rank-00001.safetensors is corrupt" in resumed.stderr
    assert "resumed from" in resumed.stdout and "step-000002 at step 2" in resumed.stdout
    # Set aside, its files kept for a look: what is left under a step's name verifies (step 4 saved again).
    assert "set aside" in resumed.stdout and (out / "checkpoints" / "corrupt-step-000004" / shard.name).is_file()
    for step_dir in sorted((out / "checkpoints").glob("step-*")):
        checkpoint.verify(step_dir)

    for step in ("step-000002", "step-000004", "step-000006"):  # nothing left that verifies
        (out / "checkpoints" / step / "manifest.json").write_text("{}")
    refused = run_main("train", "--nproc", "2", "--steps", "8", "--resume", "auto", "--out", str(out))
    assert refused.returncode == 2 and "no checkpoint under" in refused.stderr


@pytest.mark.parametrize("flag", ["--keep-last", "--ckpt-every-minutes"])
def test_negative_cadence_is_refused(tmp_path, flag):
    proc = run_main("train", flag, "-1", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "must be >= 0" in proc.stderr and not (tmp_path / "x").exists()
