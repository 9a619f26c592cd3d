"""Runs a script many times over as N ranks, each rank a process forked from this one (torch and minitrain
imported once, here) that then lives and ends as a script run by `python` does: it runs the script as __main__ and
exits through the interpreter's own shutdown (atexit, finalization, C++ destructors), where an abort would show.

    python -m tests.helpers.zygote SCRIPT RUNS NPROC [ARG...]   ->   one JSON line: each run's ranks' endings

Nothing but imports happens before a fork (no thread, no process group), so the children start clean."""
from __future__ import annotations

import gc
import json
import os
import runpy
import signal
import socket
import sys
import time

import torch
import torch._dynamo  # noqa: F401 - what a torch optimizer's first construction imports: a second per rank otherwise

import minitrain  # noqa: F401 - imported once, before the forks

RUN_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(script: str, args: list[str], run: int, rank: int, nproc: int, port: int, log: str) -> None:
    """In the child: torchrun's environment (and ZYGOTE_RUN, the run's number), output to `log`, the script as
    __main__; then out through the interpreter's exit (SystemExit propagates from here to the top, with the
    script's own status)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZYGOTE_RUN=str(run))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def _ending(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


def main(script: str, runs: int, nproc: int, args: list[str], logs: str) -> list[list[str]]:
    """Every run's ranks' endings ("exit 0", "signal SIGABRT"); each rank's output is in logs/run{N}-rank{R}.log."""
    endings = []
    for run in range(runs):
        port, pids = _free_port(), []
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                _rank(script, args, run, rank, nproc, port, os.path.join(logs, f"run{run}-rank{rank}.log"))
            pids.append(pid)
        endings.append([_ending(_wait(pid, pids, time.monotonic() + RUN_TIMEOUT_S)) for pid in pids])
    return endings


def _wait(pid: int, pids: list[int], deadline: float) -> int:
    """pid's wait status; past the deadline every rank of the run is killed (a hang ends as SIGKILL)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return os.waitpid(pid, 0)[1]
        time.sleep(0.01)


if __name__ == "__main__":
    torch.set_num_threads(1)
    gc.freeze()  # what was imported here is never collected in a child: its exits skip a long walk over it
    script, runs, nproc, *args = sys.argv[1:]
    logs = os.environ.get("ZYGOTE_LOGS", ".")
    print(json.dumps(main(script, int(runs), int(nproc), args, logs)))
