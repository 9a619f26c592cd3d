"""Run a command with CPU hogs beside it, several times in a row: does the test suite hold on a loaded machine?

    python tools/under_load.py --hogs 1 --runs 3 -- make test

Each hog is a process that spins on one core for as long as the command runs (what another job on a shared CI
machine does). The command runs RUNS times, one after another; each run's exit status and wall time are printed
and, with --json, written. Exit 0 only if every run exits 0.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import subprocess
import sys
import time


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hogs", type=int, default=1, help="CPU-bound processes beside the command (default 1)")
    parser.add_argument("--runs", type=int, default=3, help="times the command runs in a row (default 3)")
    parser.add_argument("--json", help="write the runs' statuses and times there")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.hogs < 0 or args.runs < 1:
        parser.error("give a command after --, --hogs >= 0 and --runs >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the command and the hogs go too (finally)
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    runs = []
    try:
        for run in range(1, args.runs + 1):
            started = time.monotonic()
            code = subprocess.run(command).returncode
            runs.append({"run": run, "exit": code, "seconds": round(time.monotonic() - started, 1)})
            print(f"under_load: run {run} of {args.runs}: exit {code} in {runs[-1]['seconds']:.0f} s "
                  f"with {args.hogs} hog(s)", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "hogs": args.hogs, "runs": runs}, f, indent=1)
    passed = all(r["exit"] == 0 for r in runs)
    times = ", ".join(f"{r['seconds']:.0f} s" for r in runs)
    print(f"under_load: {sum(r['exit'] == 0 for r in runs)} of {args.runs} runs passed with {args.hogs} hog(s) "
          f"beside them ({times})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
