"""A chaos campaign: one long run under many faults of every kind, which must end where the uninterrupted run ends.

    python tools/chaos.py --seed S --faults K --steps N     # `make chaos` runs three seeds

The run: ZeRO-3 on 4 ranks in float64 under torchrun (`--max-restarts`, `--resume auto`: a rank's death restarts
the ranks), a checkpoint every 10 steps in OUT/checkpoints and uploaded to an S3 server (moto's, in this process,
behind a relay that can be cut). With --nodes 2 (the default where Linux network namespaces can be made: root and
iproute2) the ranks run on two pretend machines (tests/helpers/netns.py), two each, every node under its own
torchrun agent, gloo between their addresses and the store reached over their network; the membership is fixed at
two nodes, so the world is never smaller and the run can end as one that lost nothing. This program is the
scheduler: a job that ends early (a lost node, a stop signal, torchrun out of restarts) is launched again with
`--resume auto`. The seed draws K faults, each kind once before any
kind twice, at steps at least (N - 40) / K apart:

  sigkill            a rank SIGKILLed (torchrun restarts the ranks)
  node-lost          a node SIGKILLed whole (torchrun and its ranks) and started again 2 s later: on two nodes the
                     job's next rendezvous takes it back in (node 0, which hosts the rendezvous, takes the job
                     with it: launched again); on one, the whole job
  signal             SIGTERM, SIGINT or SIGHUP to the job's process group (ranks save and stop; relaunched)
  kill-in-save       a rank SIGKILLed inside a save, its shard written, the checkpoint not yet in place
  disk-full          a rank's shard write fails with ENOSPC
  store-down         the S3 server unreachable for 3-12 s (a save's upload retries, or the run stops and resumes)
  corrupt-checkpoint bytes of the newest checkpoint's file flipped on disk, then a rank SIGKILLed: the resume must
                     not use it
  nan                a batch whose loss is NaN: the step is skipped (a data fault)
  loss-spike         a step's learning rate x 1000: the next loss spikes, the run rolls back (a data fault)
  slow-rank          a rank 0.3 s late for 5 steps

The ranks fire the faults that happen inside them (--fault.plan, once each by --fault.ledger); this program the
rest. At the end the final checkpoint's rank files (parameters, optimizer state, generator states) must equal,
byte for byte, those of one uninterrupted run that meets the same data faults (nan, loss-spike) and no other;
metrics.jsonl must hold every step once with the reference's loss; every checkpoint left (on disk and in the
store) must verify; every fault drawn must have fired. The report (OUT/chaos.json, and a table) gives per fault
the steps done again and the seconds to the next completed step, and the bytes the saves wrote. Exit 0 only when
all of it holds; the last line is the verdict.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_job import Job, NodesJob, Observer  # noqa: E402  (tools/chaos_job.py)
from tests.helpers.cable import Cable  # noqa: E402

KINDS = ("sigkill", "node-lost", "signal", "kill-in-save", "disk-full", "store-down", "corrupt-checkpoint", "nan",
         "loss-spike", "slow-rank")
IN_THE_RANKS = {"kill-in-save": "kill-in-save", "disk-full": "disk-full", "nan": "nan", "loss-spike": "lr-spike",
                "slow-rank": "slow"}  # drawn kind -> --fault.plan kind
DATA_FAULTS = ("nan", "loss-spike")  # the uninterrupted reference meets these too
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP}
NPROC, EVERY, BUCKET = 4, 10, "chaos"
# A job that logs no step for this long has hung or is looping on one failure: the campaign fails. It bounds a
# restart's start (4 ranks importing torch on a loaded machine) plus a store outage and its retries.
STALL_S = 240.0


@dataclass
class Fault:
    kind: str
    step: int
    rank: int = 0
    detail: str = ""  # the signal; the store outage's seconds
    fired_at: float | None = None
    recomputed: int | None = None
    recovery_s: float | None = None


@dataclass
class Campaign:
    seed: int
    steps: int
    faults: list[Fault]
    launches: int = 0
    notes: list[str] = field(default_factory=list)


def draw(seed: int, count: int, steps: int) -> list[Fault]:
    """K faults: every kind once (in the seed's order) before any kind twice, at steps at least (N - 40) / K apart
    between step 20 and N - 20; faults inside a save at a save step."""
    rng = random.Random(seed)
    kinds: list[str] = []
    while len(kinds) < count:
        kinds += rng.sample(KINDS, len(KINDS))
    gap = (steps - 40) // count
    if gap < EVERY + 2:
        raise ValueError(f"{count} faults over {steps} steps leave {gap} steps between faults; give --steps "
                         f"{40 + count * (EVERY + 2)} or more, or fewer --faults")
    faults = []
    for i, kind in enumerate(kinds[:count]):
        step = 20 + i * gap + rng.randrange(gap - EVERY)
        if kind in ("kill-in-save", "disk-full", "corrupt-checkpoint"):
            step = max(EVERY, step // EVERY * EVERY)
        detail = {"signal": rng.choice(sorted(SIGNALS)), "store-down": f"{rng.uniform(3, 12):.1f}"}.get(kind, "")
        faults.append(Fault(kind, step, rng.randrange(NPROC), detail))
    return faults


def common_args(steps: int) -> list[str]:
    return ["--dtype", "float64", "--zero", "3", "--global-batch", "8", "--steps", str(steps), "--ckpt-every-steps",
            str(EVERY), "--train.log_every", "0", "--timeout-s", "60", "--fault.lr_multiplier", "1000"]


def plan(faults: list[Fault], only_data: bool) -> str:
    return ",".join(f"{IN_THE_RANKS[f.kind]}@{f.step}:{f.rank}" for f in faults
                    if f.kind in IN_THE_RANKS and (f.kind in DATA_FAULTS or not only_data))


def run_reference(faults: list[Fault], steps: int, out: Path, env: dict) -> None:
    """The uninterrupted run with the data faults only, on minitrain's own launcher (the chaos run's ranks are
    torchrun's; the two train alike, bit for bit: tests/system/test_fault_tolerance.py)."""
    log = out.parent / "reference.log"
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "minitrain", "train", "--nproc", str(NPROC), *common_args(steps),
                               "--fault.plan", plan(faults, only_data=True), "--out", str(out)],
                              stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise SystemExit(f"chaos: the reference run failed (exit {code}); see {log}")


def run_chaos(campaign: Campaign, out: Path, work: Path, link: Cable, env: dict, cluster=None) -> Observer:
    """Launch, inject, relaunch until the run has saved its last step (on the cluster's two nodes, if given)."""
    from minitrain import checkpoint
    from minitrain.runtime.launch import free_port

    watch = Observer(out)
    ledger = work / "ledger"
    argv = [*common_args(campaign.steps), "--resume", "auto", "--ckpt.dir", f"s3://{BUCKET}/run",
            "--fault.plan", plan(campaign.faults, only_data=False), "--fault.ledger", str(ledger),
            "--fault.slow_s", "0.3", "--fault.slow_steps", "5", "--out", str(out)]
    outside = [f for f in campaign.faults if f.kind not in IN_THE_RANKS]
    final = out / "checkpoints" / checkpoint.step_dir_name(campaign.steps)
    job, progress = None, (0, time.monotonic())
    try:
        while not (final / "manifest.json").exists() or (job is not None and job.finished() is None):
            if job is None or job.finished() is not None:
                if campaign.launches > 3 * len(campaign.faults) + 5:
                    raise RuntimeError(f"gave up after {campaign.launches} launches; see {work}/job-*")
                campaign.launches += 1
                log, restarts = work / f"job-{campaign.launches}.log", len(campaign.faults) + 2
                job = (NodesJob(cluster, argv, NPROC, restarts, log, env, campaign.launches) if cluster else
                       Job(argv, NPROC, restarts, free_port(), log, env))
            watch.poll()
            step = watch.current_step()
            if step != progress[0]:
                progress = (step, time.monotonic())
            elif time.monotonic() - progress[1] > STALL_S:
                job.lose_node()
                raise RuntimeError(f"no step logged for {STALL_S:g} s after step {step}; see {job.logs()}")
            due = next((f for f in outside if f.fired_at is None and step >= f.step), None)
            if due is not None and _inject(due, job, out, link):
                due.fired_at = due.fired_at or time.time()  # (a lost node's: when it went down, before its return)
            time.sleep(0.1)
    finally:  # stopped early (an error, SIGTERM): the job is taken down with the campaign
        if job is not None and job.finished() is None:
            job.lose_node()
    for f in campaign.faults:  # the ranks' faults: when the ledger says they fired
        if f.kind in IN_THE_RANKS and f.kind not in ("nan", "slow-rank"):
            marks = list(ledger.glob(f"{IN_THE_RANKS[f.kind]}@{f.step}:*"))
            f.fired_at = min((m.stat().st_mtime for m in marks), default=None)
        elif f.kind in ("nan", "slow-rank"):  # tied to their step: as it first starts (the step before is logged)
            f.fired_at = next((t for s, t, _ in watch.steps if s >= f.step - 1), None)
    return watch


def _inject(f: Fault, job: Job, out: Path, link: Cable) -> bool:
    """Do fault `f` to the running job; False when it cannot be done yet (no rank process, no checkpoint)."""
    if f.kind in ("sigkill", "corrupt-checkpoint"):
        pid = job.rank_pid(f.rank)
        if pid is None:
            return False
        if f.kind == "corrupt-checkpoint":
            latest = out / "checkpoints" / "latest"
            if not latest.exists():
                return False
            shard = out / "checkpoints" / latest.read_text().strip() / f"rank-{f.rank:05d}.safetensors"
            if not shard.exists():
                return False
            with open(shard, "r+b") as file:  # flip bytes in the middle: a tensor's, not the header's
                file.seek(shard.stat().st_size // 2)
                chunk = file.read(16)
                file.seek(shard.stat().st_size // 2)
                file.write(bytes(b ^ 0xFF for b in chunk))
            f.detail = shard.parent.name
        os.kill(pid, signal.SIGKILL)
    elif f.kind == "node-lost":
        node = job.node_of(f.rank)
        if node is None:
            return False
        f.fired_at = time.time()
        job.lose_node(node)
        f.detail = f"node {node}"
        time.sleep(2.0)  # the node is down a while before the scheduler brings it back
        if node > 0:  # (node 0 hosts the rendezvous: the job went with it, and is launched again whole)
            job.bring_back(node)
    elif f.kind == "signal":
        job.signal_group(SIGNALS[f.detail])
    elif f.kind == "store-down":
        link.cut()
        threading.Timer(float(f.detail), link.restore).start()
    return True


def verdict(campaign: Campaign, out: Path, ref: Path, watch: Observer, work: Path) -> list[str]:
    """What does not hold, each in one line (empty: the campaign passed)."""
    from minitrain import checkpoint
    from minitrain.checkpoint.remote import commits, transfer
    from tests.helpers.multinode import metric_rows, shards

    failures = []
    if shards(out, campaign.steps) != shards(ref, campaign.steps):
        failures.append("the final checkpoint's rank files differ from the uninterrupted run's")
    rows, ref_rows = ([r for r in metric_rows(run) if "elapsed_s" in r] for run in (out, ref))  # steps, not events
    steps = [r["step"] for r in rows]
    if steps != list(range(1, campaign.steps + 1)):
        twice = sorted({s for s in steps if steps.count(s) > 1})
        lost = sorted(set(range(1, campaign.steps + 1)) - set(steps))
        failures.append(f"metrics.jsonl does not hold every step once, in order: twice {twice}, lost {lost}")
    elif [r["loss"] for r in rows] != [r["loss"] for r in ref_rows]:
        failures.append("metrics.jsonl's losses differ from the uninterrupted run's")
    for step_dir in sorted((out / "checkpoints").glob("step-*")):
        try:
            checkpoint.verify(step_dir)
        except Exception as e:  # noqa: BLE001  (any failure to verify is the finding)
            failures.append(f"{step_dir.name} on disk does not verify: {e}")
    failures += [f"{left.name} left half-written in OUT/checkpoints" for left in (out / "checkpoints").glob(".tmp-*")]
    url = f"s3://{BUCKET}/run"
    for step in commits.committed_steps(url):
        try:
            transfer.fetch(url, step, work / "fetched")
        except Exception as e:  # noqa: BLE001
            failures.append(f"step {step} in the store does not verify: {e}")
    failures += [f"{f.kind} at step {f.step} never fired" for f in campaign.faults if f.fired_at is None]
    return failures


def report(campaign: Campaign, watch: Observer, failures: list[str], seconds: float) -> dict:
    fired = sorted(f.fired_at for f in campaign.faults if f.fired_at is not None) + [float("inf")]
    for f in campaign.faults:
        if f.fired_at is not None:
            f.recomputed, f.recovery_s = watch.recovery(f.fired_at, fired[fired.index(f.fired_at) + 1])
    recoveries = [f.recovery_s for f in campaign.faults if f.recovery_s is not None]
    return {"seed": campaign.seed, "steps": campaign.steps, "faults": [asdict(f) for f in campaign.faults],
            "survived": sum(f.fired_at is not None for f in campaign.faults) if not failures else 0,
            "launches": campaign.launches, "recomputed_steps": sum(f.recomputed or 0 for f in campaign.faults),
            "recovery_s_median": statistics.median(recoveries) if recoveries else None,
            "recovery_s_worst": max(recoveries, default=None),
            "checkpoint_bytes_written": sum(watch.saves.values()), "checkpoints_written": len(watch.saves),
            "seconds": seconds, "failures": failures, "passed": not failures}


def print_table(result: dict) -> None:
    print(f"{'step':>5}  {'fault':<18} {'rank':>4}  {'detail':<12} {'recomputed':>10}  {'recovery s':>10}")
    for f in result["faults"]:
        rank = "" if f["kind"] in ("node-lost", "signal", "store-down", "loss-spike") else f["rank"]
        rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}"
        print(f"{f['step']:>5}  {f['kind']:<18} {rank:>4}  {f['detail']:<12} {f['recomputed'] or 0:>10}  {rec:>10}")
    print(f"{result['launches']} launches, {result['recomputed_steps']} steps recomputed, recovery median "
          f"{result['recovery_s_median'] or 0:.1f} s, worst {result['recovery_s_worst'] or 0:.1f} s; "
          f"{result['checkpoints_written']} checkpoints written, {result['checkpoint_bytes_written']:,} bytes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=10, help="K faults (default 10: every kind once)")
    parser.add_argument("--steps", type=int, default=200, help="N steps (default 200)")
    parser.add_argument("--work", help="directory for the runs and logs (default: a new temporary one, removed "
                                       "when the campaign passes)")
    parser.add_argument("--json", help="also write the report there, with the command and the machine (`make chaos`: "
                                       "benchmarks/results/chaos_seed{S}.json, the table in docs/fault-tolerance.md)")
    parser.add_argument("--nodes", type=int, choices=(1, 2), help="pretend machines the ranks run on (default 2 "
                                                                   "where network namespaces can be made, else 1)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the running job is taken down (run_chaos)
    if args.faults < 1 or args.steps < 1:
        parser.error("--faults and --steps must be positive")
    try:
        campaign = Campaign(args.seed, args.steps, draw(args.seed, args.faults, args.steps))
    except ValueError as e:
        parser.error(str(e))
    work = Path(args.work or tempfile.mkdtemp(prefix=f"chaos-{args.seed}-"))
    work.mkdir(parents=True, exist_ok=True)
    from tests.helpers import netns
    from tests.helpers.s3_server import s3_server

    cannot = netns.unavailable()
    if args.nodes == 2 and cannot:
        parser.error(f"--nodes 2: {cannot}")
    nodes = args.nodes or (1 if cannot else 2)
    started = time.monotonic()
    with s3_server(BUCKET), netns.Cluster(2) if nodes == 2 else contextlib.nullcontext() as cluster:
        server = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
        link = Cable(server, namespace=f"{cluster.name}-n0") if cluster else Cable(server)
        env = {**os.environ, "AWS_ENDPOINT_URL": f"http://{cluster.addr(0) if cluster else '127.0.0.1'}:{link.port}",
               "OMP_NUM_THREADS": "1"}
        print(f"chaos: seed {args.seed}, {args.faults} faults over {args.steps} steps on {nodes} node(s)"
              + ("" if nodes == 2 else f" ({cannot})" if cannot else "") + ": "
              + ", ".join(f"{f.kind}@{f.step}" for f in campaign.faults), flush=True)
        run_reference(campaign.faults, args.steps, work / "reference", env)
        try:
            watch = run_chaos(campaign, work / "run", work, link, env, cluster)
            failures = verdict(campaign, work / "run", work / "reference", watch, work)
        except (RuntimeError, TimeoutError) as e:
            watch, failures = Observer(work / "run"), [str(e)]
    result = report(campaign, watch, failures, time.monotonic() - started)
    (work / "chaos.json").write_text(json.dumps(result, indent=1))
    if args.json:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from record import write_result  # benchmarks/record.py

        write_result(args.json, __file__, argv, {**result, "faults_drawn": args.faults, "nproc": NPROC,
                                                "nodes": nodes, "every": EVERY})
    print_table(result)
    for failure in failures:
        print(f"chaos: {failure}")
    if not failures and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    verdict_line = (f"chaos seed {args.seed}: PASSED, {result['survived']} faults survived over {args.steps} steps, "
                    f"ends bit for bit as the uninterrupted run ({result['seconds']:.0f} s)" if not failures else
                    f"chaos seed {args.seed}: FAILED, {len(failures)} finding(s) above; runs and logs in {work}")
    print(verdict_line)
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
