"""What a chaos campaign (tools/chaos.py) acts on and watches: the training job as a scheduler runs it (torchrun in a
session of its own, its ranks found by their RANK), and the run's metrics.jsonl and checkpoints, read as they
change. (The link to the S3 server that a campaign cuts is the tests' relay, tests/helpers/cable.py.)"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Job:
    """One launch of `minitrain train ARGV` under torchrun (its own session, so that the whole job can be signalled
    or killed as a node's loss would), its output in LOG."""

    def __init__(self, argv: list[str], nproc: int, max_restarts: int, port: int, log: Path, env: dict):
        self.log = log
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
               f"--master-port={port}", f"--max-restarts={max_restarts}", "-m", "minitrain", "train", *argv]
        self.out = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)

    def rank_pid(self, rank: int) -> int | None:
        """The pid of the process running rank `rank` now (torchrun's worker with RANK=rank in its environment)."""
        return _rank_pid(self.proc.pid, rank)

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def finished(self) -> int | None:
        code = self.proc.poll()
        if code is not None and not self.out.closed:
            self.out.close()
        return code

    def node_of(self, rank: int) -> int:
        return 0

    def logs(self) -> str:
        return str(self.log)

    def lose_node(self, node: int | None = None) -> None:
        """SIGKILL torchrun and every process under it at once (it starts its ranks in sessions of their own, so a
        signal to its group reaches it alone), as the loss of the machine would."""
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.finished()



class NodesJob:
    """The same job on two pretend nodes (network namespaces, tests/helpers/netns.py), NPROC / 2 ranks each under a
    torchrun agent of its own, meeting in a c10d rendezvous on node 0. A fixed two-node membership: a node lost and
    back rejoins the job's next round, the world never smaller, so the run can end bit for bit as one that never
    lost a node. A node whose agent ends takes the job with it, as a scheduler ends a job step when one of its
    tasks fails (Slurm's --kill-on-bad-exit); the campaign then launches it again."""

    NODES = 2
    GRACE_S = 30.0

    def __init__(self, cluster, argv: list[str], nproc: int, max_restarts: int, log: Path, env: dict, launch: int):
        self.cluster, self.log, self.env = cluster, log, env
        self.entry, self.nproc, self.max_restarts = ["-m", "minitrain", "train", *argv], nproc, max_restarts
        self.run_id, self.returns = f"chaos-{launch}", 0
        self.agents = [self._start(node, log) for node in range(self.NODES)]

    def logs(self) -> str:
        return f"{self.log.parent}/{self.log.stem}-*"

    def _start(self, node: int, log: Path):
        from tests.helpers.multinode import ELASTIC_ENV, ELASTIC_RDZV  # a lost node noticed in seconds

        return self.cluster.agent(node, self.entry, nnodes=str(self.NODES), nproc=self.nproc // self.NODES,
                                  run_id=self.run_id, log=log.with_name(f"{log.stem}-node{node}"),
                                  max_restarts=self.max_restarts, rdzv_conf=ELASTIC_RDZV,
                                  env={**self.env, **ELASTIC_ENV})

    def rank_pid(self, rank: int) -> int | None:
        return next(filter(None, (_rank_pid(agent.pid, rank) for agent in self.agents)), None)

    def node_of(self, rank: int) -> int | None:
        """The node whose agent runs rank `rank` now (the rendezvous orders the nodes as they join)."""
        return next((node for node, agent in enumerate(self.agents) if _rank_pid(agent.pid, rank)), None)

    def signal_group(self, signum: int) -> None:
        """The signal to every node's agent (each forwards it to its ranks), as a scheduler cancelling the job."""
        for agent in self.agents:
            try:
                os.killpg(agent.pid, signum)
            except ProcessLookupError:
                pass

    def finished(self) -> int | None:
        """None while every node's agent runs. Once one has ended, the others are ended too (at once if it failed;
        if it succeeded, after up to GRACE_S, as they finish the same last step): 0 if all succeeded, else the
        first failure's status."""
        codes = [agent.poll() for agent in self.agents]
        if all(code is None for code in codes):
            return None
        first = next(code for code in codes if code is not None)
        if first == 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                for agent in self.agents:
                    agent.wait(timeout=self.GRACE_S)
        self.lose_node()
        codes = [agent.wait() for agent in self.agents]
        return first if first != 0 else next((code for code in codes if code != 0), 0)

    def lose_node(self, node: int | None = None) -> None:
        """SIGKILL everything on NODE (every node when None), as the machine's loss would: again while the namespace
        still holds a process (a rank its agent started as the first kill went round)."""
        for n in range(self.NODES) if node is None else (node,):
            for _ in range(100):
                self.cluster.kill_node(n)
                if not self.cluster.pids(n):
                    break
                time.sleep(0.05)
            self.agents[n].wait(timeout=60)

    def bring_back(self, node: int) -> None:
        """Start NODE's agent again: the job's next rendezvous round takes it in."""
        self.returns += 1
        self.agents[node] = self._start(node, self.log.with_name(f"{self.log.stem}-back{self.returns}"))


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


class Observer:
    """Everything the run logs, as it logs it: each step line seen (step, its time, when its process started), kept
    when a resume later drops it from metrics.jsonl, and each checkpoint written (its directory name and manifest's
    mtime, with its bytes)."""

    def __init__(self, out: Path):
        self.out = out
        self.steps: list[tuple[int, float, float]] = []  # (step, time, its process's start) in the order seen
        self._seen: set[tuple[int, float]] = set()
        self.saves: dict[tuple[str, int], int] = {}  # (step dir, manifest mtime_ns) -> bytes

    def poll(self) -> None:
        path = self.out / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "elapsed_s" in row and (row["step"], row["time"]) not in self._seen:  # a step (not an event)
                self._seen.add((row["step"], row["time"]))
                self.steps.append((row["step"], row["time"], row["time"] - row["elapsed_s"]))
        for manifest in (self.out / "checkpoints").glob("step-*/manifest.json"):
            try:
                key = (manifest.parent.name, manifest.stat().st_mtime_ns)
                if key not in self.saves:
                    self.saves[key] = sum(f.stat().st_size for f in manifest.parent.iterdir())
            except OSError:
                continue

    def current_step(self) -> int:
        """The step the run logged last (after a resume, lower than the highest logged)."""
        return self.steps[-1][0] if self.steps else 0

    def recovery(self, fired_at: float, until: float) -> tuple[int, float | None]:
        """After a fault at `fired_at` (and before the next, at `until`): (steps done again, seconds to the next step
        completed). Where the run went back (a step logged again, or a step from a process started after the fault)
        that step counts, and the steps between it and the step logged just before it were recomputed;
        otherwise the run went on: the next step, nothing recomputed."""
        before = max((s for s, t, _ in self.steps if t < fired_at), default=0)
        after = [(s, t, started) for s, t, started in self.steps if fired_at < t < until]
        if not after:
            return 0, None
        previous = before
        for step, t, started in after:
            if step <= previous or started > fired_at:
                return max(0, previous - (step - 1)), t - fired_at
            previous = step
        return 0, after[0][1] - fired_at
