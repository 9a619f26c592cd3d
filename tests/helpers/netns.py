"""Pretend machines for the multi-node tests: Linux network namespaces made by tools/netns_cluster.sh.

Each node has its own address and runs its own torchrun agent, which meets the others through a c10d
rendezvous on node 0's address; gloo talks over the nodes' eth0 (GLOO_SOCKET_IFNAME). Files are shared,
as a cluster's shared file system would be. Every process a node starts lives in that node's namespace,
so `kill_node` ends them all at once, the way a machine that loses power does.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "netns_cluster.sh"
RDZV_PORT = 29400
CLONE_NEWNET = 0x40000000  # setns(2)'s namespace type: network


def unavailable() -> str | None:
    """Why namespaces cannot be made here (the tests skip with it), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"mtprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


@contextlib.contextmanager
def inside(namespace: str):
    """This thread in network namespace NAMESPACE (one made by `ip netns add`) for the block: a socket made in it
    belongs to it for good, so a process outside can serve the nodes (setns(2) moves the calling thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{namespace}") as there, open("/proc/thread-self/ns/net") as here:
        if libc.setns(there.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {namespace}")
        try:
            yield
        finally:
            if libc.setns(here.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "cannot return to this process's network namespace")


@dataclass
class Finished:
    node: str  # the agent's name (node0, node1, node1-back, ...)
    returncode: int
    stdout: str
    stderr: str


class Cluster:
    """`nodes` namespaces under a name unique to this process; removed on exit, with all they run."""

    def __init__(self, nodes: int, name: str | None = None):
        self.nodes = nodes
        self.name = name or f"mt{os.getpid() % 100000}"

    def __enter__(self) -> Cluster:
        subprocess.run([str(SCRIPT), "up", str(self.nodes), self.name], check=True, capture_output=True, text=True)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([str(SCRIPT), "down", self.name], check=False, capture_output=True)

    def addr(self, node: int) -> str:
        return f"10.77.0.{node + 1}"

    def agent(self, node: int, entry: list[str], *, nnodes: str, nproc: int, run_id: str, log: Path,
              max_restarts: int = 0, rdzv_conf: str = "", env: dict | None = None,
              static: bool = False) -> subprocess.Popen:
        """Start node's torchrun agent for ENTRY (["-m", "minitrain", "train", ...] or [script, args...]); its
        output goes to LOG.out/LOG.err. Node 0 hosts the rendezvous store (is_host: in a namespace torchrun
        cannot tell by hostname). static: torchrun's static rendezvous instead (fixed node ranks, node 0's
        address as the master's)."""
        conf = ",".join(filter(None, [f"is_host={int(node == 0)}", rdzv_conf]))
        rendezvous = ([f"--node-rank={node}", f"--master-addr={self.addr(0)}", f"--master-port={RDZV_PORT}"]
                      if static else
                      ["--rdzv-backend=c10d", f"--rdzv-endpoint={self.addr(0)}:{RDZV_PORT}", f"--rdzv-id={run_id}",
                       f"--rdzv-conf={conf}", f"--local-addr={self.addr(node)}"])
        cmd = ["ip", "netns", "exec", f"{self.name}-n{node}", sys.executable, "-m", "torch.distributed.run",
               f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", *rendezvous, f"--max-restarts={max_restarts}",
               "--monitor-interval=0.2", *entry]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1", **(env or {})}
        return subprocess.Popen(cmd, stdout=open(f"{log}.out", "w"), stderr=open(f"{log}.err", "w"),
                                env=env, start_new_session=True)

    def pids(self, node: int) -> list[int]:
        """The processes running on the node now."""
        listing = subprocess.run(["ip", "netns", "pids", f"{self.name}-n{node}"], capture_output=True,
                                 text=True, check=False)
        return [int(pid) for pid in listing.stdout.split()]

    def kill_node(self, node: int) -> None:
        """SIGKILL everything running on the node (its agent and its ranks), as a machine loss looks."""
        for pid in self.pids(node):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        for node in range(self.nodes):
            self.kill_node(node)

    def run(self, entry: list[str], *, nodes: int, nproc: int, log_dir: Path, timeout_s: float,
            run_id: str = "job", static: bool = False) -> list[Finished]:
        """One job on nodes 0..nodes-1 (fixed membership), waited for; a hard timeout kills every node."""
        agents = [self.agent(n, entry, nnodes=str(nodes), nproc=nproc, run_id=run_id, log=log_dir / f"node{n}",
                             static=static) for n in range(nodes)]
        return self.wait(agents, log_dir, timeout_s)

    def wait(self, agents: list[subprocess.Popen], log_dir: Path, timeout_s: float,
             names: tuple[str, ...] | None = None) -> list[Finished]:
        """Wait for every agent (logs LOG_DIR/NAME.out/.err; names default to node0, node1, ...)."""
        names = names or tuple(f"node{n}" for n in range(len(agents)))
        deadline = time.monotonic() + timeout_s
        try:
            for agent in agents:
                agent.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_all()
            for agent in agents:
                agent.wait()
            raise TimeoutError(f"the job on {len(agents)} node(s) ran past {timeout_s:g} s; killed every node.\n"
                               + _logs(log_dir, names)) from None
        return [Finished(name, a.returncode, (log_dir / f"{name}.out").read_text(),
                         (log_dir / f"{name}.err").read_text()) for name, a in zip(names, agents)]


def _logs(log_dir: Path, names: tuple[str, ...]) -> str:
    tails = []
    for name in names:
        for kind in ("out", "err"):
            path = log_dir / f"{name}.{kind}"
            text = path.read_text() if path.exists() else ""
            tails.append(f"--- {name} std{kind} (tail):\n{text[-3000:]}")
    return "\n".join(tails)
