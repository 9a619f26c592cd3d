import copy
import json
import shutil
import sys
from pathlib import Path

import pytest

from minitrain.apps.demo import check_invariants

from tests.helpers.dist import run_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _check_demo_output(out: str, directory: Path) -> None:
    assert "RESUME VERIFIED" in out and out.count("[PASS]") == 4
    table = out.split("Loss per step")[1].split("Per-rank memory")[0]
    assert len([line for line in table.splitlines() if line.strip()[:2].strip().isdigit()]) == 20
    memory = out.split("Per-rank memory")[1].split("Checkpoint")[0]
    assert len([line for line in memory.splitlines() if line.strip().endswith("yes")]) == 4
    assert (directory / "checkpoints/step-000010/manifest.json").exists()
    report = json.loads((directory / "report.json").read_text())
    assert all(inv["passed"] for inv in report["invariants"])


def test_demo_runs_end_to_end(tmp_path):
    result = run_cli("demo", "--out", "demo", cwd=tmp_path, timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    _check_demo_output(result.stdout, tmp_path / "demo")


def test_the_capstone_runs_as_its_text_says(tmp_path):
    """`python3 code/main.py` with the machine's python3, as a reader types it after the set-up command: it goes
    on under the repository's .venv when that python3 has no minitrain."""
    python3 = shutil.which("python3") if (ROOT / ".venv").is_dir() else sys.executable
    result = run_cli(str(ROOT / "code/main.py"), script=True, python=python3, cwd=tmp_path, timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    _check_demo_output(result.stdout, tmp_path / "runs/capstone")


def _report():
    recs = [{"step": i + 1, "loss": 4.0 - 0.1 * i, "param_norm_per_rank": [1.5, 1.5],
             "memory": {"optimizer": [120, 120]}} for i in range(4)]
    return {"records": recs, "world_size": 2, "expected_memory": {"optimizer": 120}, "padded_params": 20,
            "checkpoint_step": 2, "steps": 4, "reload_equal_per_rank": [True, True],
            "resume_equal_per_rank": [True, True]}


def test_each_violated_invariant_is_reported():
    assert all(ok for _, ok, _ in check_invariants(_report()))
    broken = copy.deepcopy(_report())
    broken["records"][2]["loss"] = 5.0
    broken["records"][3]["param_norm_per_rank"] = [1.5, 1.5000001]
    broken["records"][3]["memory"]["optimizer"] = [120, 128]
    broken["resume_equal_per_rank"] = [True, False]
    verdicts = check_invariants(broken)
    assert [ok for _, ok, _ in verdicts] == [False, False, False, False]
    assert "rose at step 3" in verdicts[0][2] and "[3]" not in verdicts[1][2] and "[4]" in verdicts[1][2]
