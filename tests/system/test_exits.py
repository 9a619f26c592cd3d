"""A script's end, however the script ends it, is the script's: `destroy_process_group()` without cleanup() (a
DDP script's last line), cleanup() twice, sys.exit(3) between a backward and its step. Each ends with the status
the script gave, never an abort in the interpreter's shutdown, and no process group's thread outlives minitrain's
exit handler (the cause of the abort it replaced: "terminate called without an active exception" in about 1 run
in 10, when gloo's thread destroyed a finished collective while the interpreter was going away)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "helpers" / "user_scripts"
RUNS = 100  # 2 ranks each, the three endings and ZeRO 0-3 in turn (run_ending.py's `each`)
STATUS = {"destroy": "exit 0", "cleanup-twice": "exit 0", "exit-mid-step": "exit 3"}


@pytest.mark.multirank  # its ranks start in the zygote, not through the harness
def test_a_script_ends_with_its_own_status_and_no_process_group_thread_left(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.zygote", str(SCRIPTS / "run_ending.py"),
                           str(RUNS), "2", "each"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ZYGOTE_LOGS": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    endings = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(endings) == RUNS
    for run, ranks in enumerate(endings):
        mode = list(STATUS)[run % len(STATUS)]
        for rank, ending in enumerate(ranks):
            log = (tmp_path / f"run{run}-rank{rank}.log").read_text()
            where = f"{mode}, run {run} (ZeRO-{run % 4}) rank {rank}"
            assert ending == STATUS[mode], f"{where}: {ending}\n{log}"
            assert "gloo threads alive at exit: 0" in log, f"{where}:\n{log}"
