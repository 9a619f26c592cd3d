"""Multi-node runs in network namespaces, repeated: does every one finish, exit 0 and match one machine exactly,
and how long does an elastic run take to come back from a lost node.

- Exactness, `--repeats` times in a row under each of torchrun's rendezvous (c10d and static): data parallel
  and ZeRO-3 (float64, 6 steps each, in one launch) on 2 nodes x 2 ranks; a repeat passes when every agent
  exits 0, nothing aborts in teardown ("terminate called ..."), and both final checkpoints equal 4 ranks on
  one machine byte for byte.
- Elastic, `--elastic-trials` times per rendezvous setting: ZeRO-1 on 2 nodes x 2 ranks under `torchrun
  --nnodes 1:2`, node 1 SIGKILLed whole after step 40, brought back 5 steps after the survivors resumed.
  Recovery = the kill to the first step completed after it; regrow = node 1's agent started again to the first
  step at 4 ranks. The final state is compared with a run that never changed size (float64: largest absolute
  difference over every tensor of the final checkpoint; different sizes sum the same gradients in another
  order, so ~1e-16, not 0).

Needs root (network namespaces). Results: benchmarks/results/multinode.json, the table in docs/multi-node.md.

    .venv/bin/python benchmarks/multinode.py [--repeats 20] [--elastic-trials 3]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from record import RESULTS, write_result  # benchmarks/record.py
from safetensors.torch import load_file

sys.path.insert(0, str(RESULTS.parent.parent))  # the repository root: the clusters and runs of tests/ are reused


from minitrain.runtime.launch import launch
from minitrain.train.metrics import format_table
from tests.helpers.multinode import ELASTIC_RDZV, THIS, elastic_run, shards, train_each
from tests.helpers.netns import Cluster, unavailable

LAYOUTS = {"dp": ["--zero", "0"], "zero3": ["--zero", "3"]}
EXACT = ["--dtype", "float64", "--train.log_every", "0", "--steps", "6"]
ELASTIC = ["--dtype", "float64", "--zero", "1", "--global-batch", "8", "--steps", "400", "--ckpt-every-steps", "20",
           "--train.log_every", "0", "--timeout-s", "60"]
# torchrun's own heartbeat and last-call timing beside the faster one tests/helpers/multinode.py uses.
RDZV = {"torchrun defaults": "", "fast heartbeats": ELASTIC_RDZV}
# The exactness job under both of torchrun's rendezvous: c10d (what the docs recommend) and the static one
# (--node-rank, --master-addr), where aborts in teardown were first reported.
JOB_RDZV = ("c10d", "static")


def runs(root: Path) -> list[list[str]]:
    return [[*EXACT, *args, "--out", str(root / name)] for name, args in LAYOUTS.items()]


def repeat(cluster: Cluster, root: Path, reference: Path, static: bool) -> dict:
    root.mkdir(parents=True)
    (root / "runs.json").write_text(json.dumps(runs(root)))
    start = time.monotonic()
    try:
        # 60 s: a job takes about 8; one whose rank aborted in teardown leaves the other node's agent in
        # torchrun's exit barrier (300 s) and counts as a failure either way.
        finished = cluster.run([THIS, str(root / "runs.json")], nodes=2, nproc=2, log_dir=root, timeout_s=60,
                               static=static)
    except TimeoutError as e:
        return {"passed": False, "rc": "timeout", "wall_s": round(time.monotonic() - start, 1), "tail": str(e)[-600:]}
    rcs = [f.returncode for f in finished]
    aborted = any("terminate called" in f.stderr for f in finished)
    identical = all(rcs == [0, 0] and shards(root / n, 6) == shards(reference / n, 6) for n in LAYOUTS)
    return {"passed": rcs == [0, 0] and not aborted and identical, "rc": rcs, "aborted_in_teardown": aborted,
            "bit_identical": identical, "wall_s": round(time.monotonic() - start, 1),
            "tail": "" if rcs == [0, 0] else "\n".join(f.stderr[-600:] for f in finished)}


def max_difference(a: Path, b: Path, step: int) -> float:
    worst = 0.0
    for name in shards(a, step):
        ours, theirs = load_file(a / "checkpoints" / f"step-{step:06d}" / name), \
            load_file(b / "checkpoints" / f"step-{step:06d}" / name)
        for key, tensor in ours.items():
            if tensor.is_floating_point() and not key.startswith("rng"):
                worst = max(worst, float((tensor - theirs[key]).abs().max()))
    return worst


def elastic_trial(cluster: Cluster, root: Path, rdzv: str, uninterrupted: Path) -> dict:
    root.mkdir(parents=True)
    try:
        run = elastic_run(cluster, ELASTIC, root / "run", root, nproc=2, kill_after=40, steps_between=5,
                          rdzv_conf=rdzv, quiet_s=300)
    except TimeoutError as e:
        return {"passed": False, "error": str(e)[-600:]}
    rcs = [f.returncode for f in run.finished]
    worlds = [s[0] for s in run.segments]
    return {"passed": rcs == [0, 0] and worlds == [4, 2, 4], "rc": rcs, "segments": run.segments,
            "recovery_s": round(run.recovery_s, 1), "regrow_s": round(run.regrow_s, 1),
            "max_abs_diff_vs_uninterrupted": max_difference(root / "run", uninterrupted, 400)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--elastic-trials", type=int, default=3)
    parser.add_argument("--out", default="runs/bench-multinode")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        sys.exit(f"benchmarks/multinode.py: {reason}")
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    launch(train_each, 4, runs(root / "one-machine"), backend="gloo", timeout_s=300)
    uninterrupted = root / "uninterrupted"
    launch(train_each, 4, [[*ELASTIC, "--out", str(uninterrupted)]], backend="gloo", timeout_s=600)
    results: dict = {"exactness": {kind: [] for kind in JOB_RDZV}, "elastic": {name: [] for name in RDZV}}
    with Cluster(2, "mtbench") as cluster:
        for i in range(args.repeats):  # interleaved, so machine noise hits both rendezvous alike
            for kind in JOB_RDZV:
                r = repeat(cluster, root / f"repeat-{kind}-{i}", root / "one-machine", static=kind == "static")
                results["exactness"][kind].append(r)
                print(f"repeat {i} {kind}: passed={r['passed']} rc={r['rc']} {r['wall_s']} s "
                      f"{r.get('tail', '')[-300:]!r}", flush=True)
        for i in range(args.elastic_trials):  # interleaved, so machine noise hits both settings alike
            for name, rdzv in RDZV.items():
                r = elastic_trial(cluster, root / f"elastic-{name.replace(' ', '-')}-{i}", rdzv, uninterrupted)
                results["elastic"][name].append(r)
                print(f"elastic {name} {i}: {r}", flush=True)
    for kind, exact in results["exactness"].items():
        print(f"exactness, {kind} rendezvous: {sum(r['passed'] for r in exact)}/{len(exact)} repeats passed")
    rows = [[name, f"{sum(t['passed'] for t in ts)}/{len(ts)}",
             " ".join(f"{t['recovery_s']:.1f}" for t in ts if "recovery_s" in t),
             " ".join(f"{t['regrow_s']:.1f}" for t in ts if "regrow_s" in t)] for name, ts in results["elastic"].items()]
    print(format_table(["rendezvous", "passed", "recovery s", "regrow s"], rows, "<>>>"))
    path = write_result(RESULTS / "multinode.json", __file__, None, {"repeats": args.repeats,
                                                                      "elastic_trials": args.elastic_trials,
                                                                      "rdzv_conf": RDZV, **results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
