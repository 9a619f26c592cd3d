"""A short chaos campaign (tools/chaos.py): one run of ZeRO-3 on 4 ranks under torchrun meets three faults drawn by a
fixed seed (the store unreachable, SIGHUP to the job, a checkpoint corrupted on disk and a rank killed) and must end
bit for bit where the uninterrupted run ends, every step logged once, every checkpoint left verifying. On one node:
`make chaos` runs the long campaigns, on two pretend nodes where it can (docs/fault-tolerance.md); the two-node
rendezvous of a node that comes back is tests/runtime/test_launch.py's and test_multinode's elastic run's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="moto is not installed (the test extra installs it)")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# The campaign's own guard ends a job that logs no step for 240 s; this bounds the whole of it (the reference run,
# 80 steps, three faults and their restarts: under a minute on a quiet machine) with room for a loaded one.
LIMIT_S = 900


@pytest.mark.multirank  # its ranks start under torchrun, from the tool
def test_a_short_campaign_ends_bit_for_bit_as_the_uninterrupted_run(tmp_path):
    proc = subprocess.Popen([sys.executable, "tools/chaos.py", "--seed", "7", "--faults", "3", "--steps", "80",
                             "--nodes", "1", "--work", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the tool takes its running job (a session of its own) down with it
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"the campaign did not end within {LIMIT_S} s:\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]
    assert out.strip().splitlines()[-1].startswith("chaos seed 7: PASSED, 3 faults survived over 80 steps"), out
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert [f["kind"] for f in report["faults"]] == ["store-down", "signal", "corrupt-checkpoint"]
    assert all(f["fired_at"] is not None for f in report["faults"]) and report["passed"]
    assert report["launches"] >= 2  # the signal stopped the job, and it was launched again
