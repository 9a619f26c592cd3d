"""Start ranks and make their failures loud.

Two ways in:
- `launch(fn, nproc, ...)` starts `nproc` processes on 127.0.0.1 with a free
  port and torchrun's environment variables, runs `fn(topology, *args)` on
  each, and returns every rank's result. If any rank raises or dies, every
  other rank is killed and `RankFailedError` carries the first failing rank
  and its traceback (shown once). A hard `timeout_s` turns a hang into
  `LaunchTimeoutError`. Ranks named in `may_leave` are the exception: one that
  fails is said to have left (one line on stderr, and a key in the run's store,
  left_key, for the ranks that go on without it: parameter servers' elastic
  workers), and its result is None. The test harness and `--nproc N` both use it. A collective
  stuck past `pg_timeout_s` ends every rank with one diagnosis naming the rank
  that is elsewhere (runtime/watch.py); that rank's report comes first.
- `run_under_torchrun(fn, ...)` runs `fn` in this process, as the rank that
  torchrun's environment names; torchrun itself tears down the other ranks.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Collection
from datetime import timedelta
from multiprocessing.connection import wait

from .comm import CollectiveError
from ..errors import ConfigError
from .signals import SECOND_INTERRUPT_S, STOP_SIGNALS, SecondInterrupt

# After the first failure, collect reports this long: the root cause usually
# reports first, but peers whose collectives broke report right after.
FAILURE_GRACE_S = 0.5
# Ranks that reported a result get this long to tear down before being killed.
TEARDOWN_S = 10.0


@dataclass
class RankFailure:
    rank: int
    detail: str  # traceback, or how the process ended
    when: float  # time.time() of the failure, to pick the root cause
    # True when the rank failed because a collective broke, i.e. most likely because a peer
    # died: such a failure is the root cause only if nothing else failed.
    collective: bool = False
    refusal: str | None = None  # a ConfigError's message: the rank refused what it was given (exit 2, one line)


class RankFailedError(RuntimeError):
    def __init__(self, failure: RankFailure, others: list[int]):
        self.rank, self.detail, self.others = failure.rank, failure.detail, others
        also = f" (ranks {others} stopped after it)" if others else ""
        super().__init__(f"rank {failure.rank} failed{also}:\n{failure.detail.rstrip()}")


class LaunchTimeoutError(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (never a hard-coded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _environ(**values: str):
    """Set environment variables for the duration of the block."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _die_with_launcher(lifeline) -> None:
    """End this rank the moment the launcher is gone, so no orphans. A rank's parent is the fork
    server, which outlives the launcher while ranks hold it open, so the kernel's parent-death
    signal alone is not enough: the rank also watches a pipe only the launcher can write to, and
    end-of-file on it means the launcher died."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (fork server)
        except OSError:
            pass

    def watch():
        try:
            lifeline.recv_bytes()  # the launcher never writes: this returns only by raising EOFError
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-lifeline", daemon=True).start()


def _send(conn, message) -> None:
    """Send by value with plain pickle. Connection.send would use torch's reductions, which
    pass tensors as shared-memory handles fetched from this process: gone once it exits."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _rank_context():
    """Ranks start from a fork server that has imported torch and minitrain once: each rank is
    forked from it with them loaded, instead of importing them again (torch's import is a large part
    of a rank's start). The server itself is a fresh process that only imported modules: it holds no
    CUDA context and has run no thread pool, so forking from it is safe (it is how
    torch.multiprocessing's "forkserver" start method is meant to be used). torch._dynamo too: a torch optimizer's
    first construction imports it, a second of CPU per rank otherwise (before any process group, as topology.py
    needs)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "minitrain.train.loop", "minitrain.runtime._forkserver"])
    return ctx


def _rank_main(fn, args, rank, nproc, port, backend, pg_timeout_s, threads, conn, lifeline, environ) -> None:
    _die_with_launcher(lifeline)
    # Forked from the server, a rank has the server's environment (the launcher's when the server started), not
    # the launcher's now: set that here (a variable set since, e.g. a store's credentials, reaches the ranks).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    import torch

    from .topology import Topology

    torch.set_num_threads(threads)
    pipe = threading.Lock()  # the collective watch's thread may report a hang on the same pipe

    def report(text: str, culprit: bool) -> None:
        """A hang diagnosis from the watch's thread, as this rank's error (it then ends the process)."""
        with pipe:
            _send(conn, ("error", text, time.time(), not culprit))

    topo = None
    try:
        topo = Topology.from_env(backend, pg_timeout_s, report)
        result = fn(topo, *args)
        with pipe:
            _send(conn, ("ok", result))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        with pipe:
            _send(conn, ("error", traceback.format_exc(), time.time(), _secondary(e),
                         str(e) if isinstance(e, ConfigError) else None))
        conn.close()
        os._exit(1)  # skip teardown that could block on dead peers; the launcher reaps us
    if topo is not None:
        topo.close()
    conn.close()


def _secondary(e: BaseException) -> bool:
    """A failure that follows from another rank's: a broken collective, unless its diagnosis names this rank
    (the trainer re-raises a CollectiveError with the step, so look down the chain)."""
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    if any(getattr(x, "culprit", False) for x in chain):
        return False
    return isinstance(e, CollectiveError) or getattr(e, "caused_by_peer", False)


LOCAL_RANKS_PER_CPU = 8  # beyond this, a machine spends its time switching between ranks, and runs out of them


def check_local_ranks(nproc: int) -> None:
    """ConfigError unless this machine can start `nproc` ranks of its own (torchrun's ranks are not counted)."""
    limit = LOCAL_RANKS_PER_CPU * (os.cpu_count() or 1)
    if nproc > limit:
        raise ConfigError(f"--nproc {nproc} ranks on one machine with {os.cpu_count()} CPUs is more than {limit} "
                          f"({LOCAL_RANKS_PER_CPU} per CPU); use fewer, or torchrun across machines")


def left_key(rank: int) -> str:
    """The key of the run's store (the rendezvous store rank 0 holds) under which the launcher says how a rank it
    let leave ended."""
    return f"minitrain/left/{rank}"


def launch(fn, nproc: int, *args, backend: str = "auto", pg_timeout_s: float = 300.0,
           threads_per_rank: int = 1, timeout_s: float | None = None, may_leave: Collection[int] = ()) -> list:
    """Run fn(topology, *args) on nproc local ranks; return their results in rank order.

    fn must be importable (a module-level function): ranks are forked from a fork server,
    not from this process, so no parent thread or CUDA state leaks into them.
    """
    ctx = _rank_context()
    port = free_port()
    procs, conns, lifelines = [], {}, []
    threads = str(threads_per_rank)
    try:
        # The fork server, started by the first launch, inherits this environment (its torch import then
        # sizes no large thread pool); each rank sets its own again in _rank_main.
        with _environ(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads):
            for rank in range(nproc):
                recv_end, send_end = ctx.Pipe(duplex=False)
                watch_end, hold_end = ctx.Pipe(duplex=False)  # held open here until the ranks are gone
                p = ctx.Process(target=_rank_main, name=f"minitrain-rank{rank}", daemon=True,
                                args=(fn, args, rank, nproc, port, backend, pg_timeout_s, threads_per_rank, send_end,
                                      watch_end, dict(os.environ)))
                procs.append(p)
                p.start()
                send_end.close()
                watch_end.close()
                conns[recv_end] = rank
                lifelines.append(hold_end)
        with _forwarding_stop_signals(procs):
            results = _supervise(procs, conns, timeout_s, _Departures(may_leave, port))
        for p in procs:  # every rank reported; let each destroy its process group and exit
            p.join(timeout=TEARDOWN_S)
        return results
    finally:
        _kill_all(procs)
        for hold_end in lifelines:
            hold_end.close()


@contextmanager
def _forwarding_stop_signals(procs):
    """A scheduler's SIGTERM or SIGUSR1, a Ctrl-C or a hang-up to the launcher is passed on to every rank, which
    saves a checkpoint and finishes; the launcher keeps supervising them meanwhile. A second Ctrl-C (at least
    SECOND_INTERRUPT_S after the first) raises SecondInterrupt here: the ranks are then killed (launch's
    finally), and what they trained since their last checkpoint is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first_interrupt: list[float] = []

    def forward(signum, _frame):
        if signum == signal.SIGINT:
            if first_interrupt and time.monotonic() - first_interrupt[0] >= SECOND_INTERRUPT_S:
                raise SecondInterrupt("interrupted again: the ranks are stopped at once")
            if not first_interrupt:
                first_interrupt.append(time.monotonic())
                print("interrupt: every rank saves a checkpoint after its current step, then stops (Ctrl-C again "
                      "to stop at once, without it)", file=sys.stderr, flush=True)
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Departures:
    """The ranks allowed to leave a run, and those that did: each is posted in the run's store, where the ranks that
    go on look for it (the store is rank 0's, which is never among them)."""

    def __init__(self, may_leave: Collection[int], port: int):
        self.may_leave, self.port = frozenset(may_leave), port
        self.left: dict[int, str] = {}

    def takes(self, failure: RankFailure) -> bool:
        """Let this failure's rank leave (True), or not: it is then the run's failure."""
        if failure.rank not in self.may_leave or failure.refusal is not None:
            return False
        how = (failure.detail.strip().splitlines() or ["no detail"])[-1]
        self.left[failure.rank] = how
        print(f"minitrain: rank {failure.rank} left the run ({how}); the others go on without it", file=sys.stderr,
              flush=True)
        import torch.distributed as dist

        try:
            store = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=5))
            store.set(left_key(failure.rank), how)
        except (RuntimeError, OSError) as e:  # rank 0 gone too: its own failure ends the run
            print(f"minitrain: could not tell the run that rank {failure.rank} left: {e}", file=sys.stderr)
        return True


def _supervise(procs, conns: dict, timeout_s: float | None, departures: _Departures) -> list:
    nproc = len(procs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    results: dict[int, object] = {}
    failures: list[RankFailure] = []
    first_failure_at = None

    def read(conn) -> None:
        rank = conns.pop(conn)
        try:
            msg = pickle.loads(conn.recv_bytes())  # from our own child process
        except EOFError:
            return  # closed without a message: the sentinel reports how the process ended
        except (OSError, pickle.UnpicklingError) as e:
            failures.append(RankFailure(rank, f"its result could not be received: {e!r}", time.time()))
            return
        if msg[0] == "ok":
            results[rank] = msg[1]
        else:
            failed(RankFailure(rank, *msg[1:]))

    def failed(failure: RankFailure) -> None:
        if departures.takes(failure):
            results[failure.rank] = None
        else:
            failures.append(failure)

    while len(results) < nproc:
        now = time.monotonic()
        if first_failure_at is not None and now - first_failure_at >= FAILURE_GRACE_S:
            break
        if deadline is not None and now >= deadline:
            stuck = sorted(set(range(nproc)) - set(results))
            raise LaunchTimeoutError(f"ranks {stuck} still running after {timeout_s:g} s; "
                                     "killed the whole group (a hang, or a timeout set too short)")
        wait_s = 0.1 if first_failure_at is not None else (None if deadline is None else deadline - now)
        for obj in wait(list(conns) + list(sentinels), timeout=wait_s):
            if obj in conns:
                read(obj)
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                conn = next((c for c, r in conns.items() if r == rank), None)
                if conn is not None and conn.poll():
                    read(conn)
                if rank not in results and all(f.rank != rank for f in failures):
                    procs[rank].join(timeout=1)  # the sentinel fires before the exit code is reaped
                    failed(RankFailure(rank, _exit_description(procs[rank].exitcode), time.time()))
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
    if failures:
        # A rank that died silently is stamped when the launcher noticed, which can be after
        # its peers' broken collectives: so prefer failures that are not collective breakage.
        root = min(failures, key=lambda f: (f.collective, f.when))
        if root.refusal is not None:  # something to fix, said in one line (the CLI exits 2)
            raise ConfigError(f"rank {root.rank}: {root.refusal}")
        raise RankFailedError(root, sorted(f.rank for f in failures if f is not root))
    return [results[r] for r in range(nproc)]


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"process killed by {signal.Signals(-code).name} before reporting a result"
    return f"process exited with code {code} before reporting a result"


def _kill_all(procs) -> None:
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)


def run_under_torchrun(fn, *args, backend: str = "auto", pg_timeout_s: float = 300.0,
                       threads_per_rank: int = 1):
    """Run fn(topology, *args) as the rank torchrun's environment names; return its result."""
    import torch

    from .topology import Topology

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank)

    def report(text: str, culprit: bool) -> None:
        """A hang diagnosis from the collective watch's thread, shown as a failure is (the watch then exits 1)."""
        print(f"[rank {os.environ.get('RANK', '?')}] failed:\n{text}", file=sys.stderr, flush=True)

    topo = Topology.from_env(backend, pg_timeout_s, report)
    try:
        return fn(topo, *args)
    except ConfigError as e:  # something to fix, in one line
        print(f"[rank {topo.rank}] error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except Exception:
        # Shown once here; torchrun reports the exit code and ends the other ranks.
        print(f"[rank {topo.rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        topo.close()
