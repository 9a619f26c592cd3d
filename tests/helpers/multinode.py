"""What the multi-node tests and benchmarks/multinode.py run: several training configurations in one launch,
and the elastic scenario (lose a node, go on smaller, take it back).

As a script under torchrun: `python tests/helpers/multinode.py RUNS.json` trains each run of the JSON list (each a
list of `minitrain train` arguments) one after another in one process group, so a test pays for one launch
(agents, rendezvous, starting the ranks) instead of one per configuration. `train_each` is the same job for
the single-machine reference (tests.helpers.dist.run_ranks).
"""
from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from minitrain.apps.cli import build_parser, resolve_config
from minitrain.train.loop import train_worker
from tests.helpers.events import until, written
from tests.helpers.netns import Cluster, Finished

THIS = str(Path(__file__).resolve())
# The elastic restarts: TCP-store sharing off (torch's shared store loses the next round's MASTER_ADDR when a
# node joins, and the agents wait on each other until the store times out), and a dead node noticed after 3 s
# of missed heartbeats instead of 15; a round closes 1 s after its last joiner.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
ELASTIC_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def train_each(topo, runs: list[list[str]]) -> list[dict]:
    """Every rank: train each run (`minitrain train` arguments) in turn in this process group."""
    results = []
    for argv in runs:
        cfg = resolve_config(build_parser().parse_args(["train", *argv]))
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        results.append(train_worker(topo, cfg))
    return results


def shards(out: Path, step: int) -> dict[str, bytes]:
    """The rank files of OUT's checkpoint at `step`: parameters, optimizer state, generator states."""
    step_dir = out / "checkpoints" / f"step-{step:06d}"
    files = {f.name: f.read_bytes() for f in sorted(step_dir.glob("rank-*.safetensors"))}
    assert files, f"no checkpoint at {step_dir}"
    return files


def metric_rows(out: Path) -> list[dict]:
    """The step lines of OUT/metrics.jsonl (a line cut short while being written is left out)."""
    rows = []
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in row:
            rows.append(row)
    return rows


def segments(rows: list[dict]) -> list[tuple[int, int, int]]:
    """(world size, first step, last step) of each stretch of the run at one world size."""
    spans: list[list[int]] = []
    for row in rows:
        world = len(row["busy_s_per_rank"])
        if not spans or spans[-1][0] != world:
            spans.append([world, row["step"], row["step"]])
        spans[-1][2] = row["step"]
    return [tuple(s) for s in spans]


@dataclass
class ElasticRun:
    segments: list[tuple[int, int, int]]
    recovery_s: float  # node 1 killed -> the first step completed after it (at the smaller world)
    regrow_s: float  # node 1's agent started again -> the first step completed at the full world
    finished: list[Finished]


def _wait_for(what: str, condition, quiet_s: float, cluster: Cluster, activity):
    """condition()'s first true value; the wait ends (every node killed) only once the run has written nothing for
    quiet_s (tests/helpers/events.py): a loaded machine's slow rendezvous and restarts are waited for."""
    return until(f"{what} in the elastic run", condition, quiet_s, activity, on_timeout=cluster.kill_all)


def elastic_run(cluster: Cluster, argv: list[str], out: Path, log_dir: Path, *, nproc: int, kill_after: int,
                steps_between: int, rdzv_conf: str = ELASTIC_RDZV, quiet_s: float = 240.0) -> ElasticRun:
    """`minitrain train ARGV --out OUT` on nodes 0 and 1 under `torchrun --nnodes 1:2`: once step KILL_AFTER is
    logged, node 1 is SIGKILLed whole (agent and ranks); node 0 restarts at the smaller world; after
    STEPS_BETWEEN steps there, node 1 starts again and the next restart takes it back in. Each wait lasts as long as
    the agents or ranks write something (logs, metrics, checkpoints) at least every quiet_s seconds.

    The smaller world then holds (--fault.plan hold@STEP): its ranks wait at the start of that step until torchrun
    stops them for the node that joins, however long that node takes to start, and the restart takes it in from
    there. (Without the hold, a fast smaller world ran its last 360 steps in 4 s, while node 1's agent was still
    starting on a loaded machine, and the job ended before it came back.) The step is STEPS_BETWEEN past the loss:
    the full world, still running while the test reacts to KILL_AFTER, must not reach it first."""
    hold = kill_after + steps_between + 1
    entry = ["-m", "minitrain", "train", *argv, "--fault.plan", f"hold@{hold}", "--fault.ledger",
             str(log_dir / "fault-ledger"), "--out", str(out)]
    options = {"nnodes": "1:2", "nproc": nproc, "run_id": "elastic", "max_restarts": 2,
               "rdzv_conf": rdzv_conf, "env": ELASTIC_ENV}
    agents = [cluster.agent(node, entry, log=log_dir / f"node{node}", **options) for node in (0, 1)]
    activity = functools.partial(written, log_dir, out)
    _wait_for(f"step {kill_after}", lambda: any(r["step"] >= kill_after for r in metric_rows(out)), quiet_s,
              cluster, activity)
    killed_at = time.time()
    cluster.kill_node(1)
    agents[1].wait()

    def after(t: float, world: int | None = None) -> list[dict]:
        return [r for r in metric_rows(out) if r["time"] > t and world in (None, len(r["busy_s_per_rank"]))]

    # At the smaller world: a step the full world logged as node 1 died is rolled back with the resume.
    first = _wait_for("step after the node loss", lambda: after(killed_at, world=nproc), quiet_s, cluster,
                      activity)[0]
    _wait_for(f"step {hold - 1} at the smaller world", lambda: [r for r in after(killed_at, world=nproc)
                                                                 if r["step"] == hold - 1], quiet_s, cluster, activity)
    back_at = time.time()
    agents.append(cluster.agent(1, entry, log=log_dir / "node1-back", **options))
    grown = _wait_for("step at the full world again", lambda: after(back_at, world=2 * nproc), quiet_s, cluster,
                      activity)[0]
    _wait_for("end of the run", lambda: all(a.poll() is not None for a in (agents[0], agents[2])), quiet_s, cluster,
              activity)
    finished = cluster.wait([agents[0], agents[2]], log_dir, 60, names=("node0", "node1-back"))  # (both have ended)
    return ElasticRun(segments(metric_rows(out)), first["time"] - killed_at, grown["time"] - back_at, finished)


if __name__ == "__main__":
    from minitrain.runtime.launch import run_under_torchrun

    run_under_torchrun(train_each, json.loads(Path(sys.argv[1]).read_text()), backend="gloo", pg_timeout_s=60)
