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

HERE = Path(__file__).resolve().parent
RUNS = {"destroy": 34, "cleanup-twice": 33, "exit-mid-step": 33}  # 100 runs, 2 ranks each, ZeRO 0-3 in turn
STATUS = {"destroy": "exit 0", "cleanup-twice": "exit 0", "exit-mid-step": "exit 3"}


def test_a_script_ends_with_its_own_status_and_no_process_group_thread_left(tmp_path):
    started = {}
    for mode, runs in RUNS.items():  # the three at once: each run mostly waits for its ranks to meet
        (tmp_path / mode).mkdir()
        started[mode] = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", str(HERE / "user_scripts" / "run_ending.py"), str(runs), "2", mode],
            cwd=HERE.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "ZYGOTE_LOGS": str(tmp_path / mode), "OMP_NUM_THREADS": "1"})
    for mode, proc in started.items():
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in started.values():
                p.kill()
            pytest.fail(f"{mode}: the runs did not end within 300 s")
        assert proc.returncode == 0, err
        endings = json.loads(out.strip().splitlines()[-1])
        assert len(endings) == RUNS[mode]
        for run, ranks in enumerate(endings):
            for rank, ending in enumerate(ranks):
                log = (tmp_path / mode / f"run{run}-rank{rank}.log").read_text()
                where = f"{mode}, run {run} (ZeRO-{run % 4}) rank {rank}"
                assert ending == STATUS[mode], f"{where}: {ending}\n{log}"
                assert "gloo threads alive at exit: 0" in log, f"{where}:\n{log}"
