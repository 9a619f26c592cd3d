"""The multi-rank test harness. Every multi-rank test goes through here.

- `run_ranks(fn, world_size, *args)`: spawns `world_size` gloo ranks on a free
  port, one thread each, runs `fn(topology, *args)` (a module-level function)
  and returns every rank's result. A hard timeout kills the whole group; a
  failure fails the test with the failing rank and its traceback.
- `run_cli(*argv)`: runs the `minitrain` command (or torchrun) as a subprocess
  in its own process group; a hard timeout kills the group.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from minitrain.runtime.launch import LaunchTimeoutError, RankFailedError, free_port, launch

DEFAULT_TIMEOUT_S = 90.0


def run_ranks(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    try:
        return launch(fn, world_size, *args, backend="gloo", pg_timeout_s=timeout_s, timeout_s=timeout_s)
    except RankFailedError as e:
        pytest.fail(f"{fn.__name__} on {world_size} ranks: {e}", pytrace=False)
    except LaunchTimeoutError as e:
        pytest.fail(f"{fn.__name__} on {world_size} ranks timed out: {e}", pytrace=False)


def run_cli(*argv: str, cwd=None, timeout_s: float = DEFAULT_TIMEOUT_S, torchrun_nproc: int = 0,
            torchrun_args: tuple[str, ...] = (), env: dict | None = None,
            script: bool = False, python: str = sys.executable) -> subprocess.CompletedProcess:
    """`minitrain ARGV...` (or torchrun with N local ranks and `torchrun_args`), output captured as text.
    script: ARGV[0] is a Python script to run instead of the minitrain command; python: the interpreter."""
    target = list(argv) if script else ["-m", "minitrain", *argv]
    if torchrun_nproc:
        cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={torchrun_nproc}",
               "--nnodes=1", f"--master-port={free_port()}", *torchrun_args, *target]
    else:
        cmd = [python, *target]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`{' '.join(argv)}` hung past {timeout_s:g} s; killed its process group.\n"
                    f"stdout:\n{out}\nstderr:\n{err}", pytrace=False)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_cli_and_signal(*argv: str, signum: int, after_line: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                       to_group: bool = False, again_after_s: float | None = None) -> subprocess.CompletedProcess:
    """`minitrain ARGV...`; once a stdout line contains `after_line`, send `signum` to the
    minitrain process itself (as a scheduler would), or with `to_group` to its whole process group (as
    `timeout`, `kill -- -PGID`, Slurm's job cancellation and a terminal's Ctrl-C do), and again after
    `again_after_s` seconds if given (a second Ctrl-C); then wait until its output closes, i.e.
    until it and every rank it started are gone. A hard timeout kills the process group."""
    cmd = [sys.executable, "-m", "minitrain", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    hung = threading.Event()

    def kill_group():
        hung.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill_group)
    timer.start()
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if after_line in line:
                for attempt in range(1 if again_after_s is None else 2):
                    if attempt:
                        time.sleep(again_after_s)
                    if to_group:
                        os.killpg(proc.pid, signum)
                    else:
                        proc.send_signal(signum)
                break
        out, err = proc.communicate()
    finally:
        timer.cancel()
    if hung.is_set():
        pytest.fail(f"`{' '.join(argv)}` hung past {timeout_s:g} s; killed its process group.\n"
                    f"stdout:\n{''.join(seen)}{out}\nstderr:\n{err}", pytrace=False)
    result = subprocess.CompletedProcess(cmd, proc.returncode, "".join(seen) + out, err)
    result.pid = proc.pid  # also its process group's id
    return result


def run_main(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    """`minitrain ARGV...` in this process (no interpreter start-up): for commands that end before
    launching any rank, such as refused input. Same result shape as run_cli."""
    import contextlib
    import io

    from minitrain.apps.cli import main

    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse's usage errors
                code = e.code
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess(["minitrain", *argv], code, out.getvalue(), err.getvalue())


def _script_rank(path: str, argv: list[str], rank: int, nproc: int, port: int, log: str, environ: dict) -> None:
    """One rank of run_script: torchrun's environment, its output to `log`, the script run as __main__."""
    import runpy

    os.environ.clear()
    os.environ.update(environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a script: its traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_script(path, nproc: int, *argv: str, logs, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[tuple[int, str]]:
    """A user's script on `nproc` ranks as torchrun runs it (its environment; the script joins the process group
    itself), each rank forked from the launcher's fork server (torch already imported: no interpreter start-up)
    instead of a new interpreter. Returns each rank's (exit code, output). A hard timeout kills every rank and fails
    the test with their output so far. `logs`: a directory for the ranks' output files."""
    from minitrain.runtime.launch import _rank_context

    ctx, port = _rank_context(), free_port()
    files = [os.path.join(str(logs), f"rank{r}.log") for r in range(nproc)]
    procs = [ctx.Process(target=_script_rank, daemon=True,
                         args=(str(path), list(argv), r, nproc, port, files[r], dict(os.environ)))
             for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    outputs = [open(f).read() if os.path.exists(f) else "" for f in files]
    if hung:
        pytest.fail(f"{os.path.basename(str(path))} {' '.join(argv)} hung past {timeout_s:g} s on rank(s) {hung}; "
                    "killed.\n" + "\n".join(f"--- rank {r}:\n{out}" for r, out in enumerate(outputs)), pytrace=False)
    return [(p.exitcode, out) for p, out in zip(procs, outputs)]
