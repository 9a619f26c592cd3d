"""`minitrain bench scaling`: the 1-vs-N processes experiment.

Trains the same model for S steps with 1 process, then 2 (then 4 with
--max-procs 4): gloo on CPU, one thread per rank, bucketed data parallel,
disjoint data shards. Even steps are bracketed by barriers so the gradient
sync is timed (see trainer.train_step); odd steps run untouched and give the
throughput, so the measuring does not slow down what is measured. Writes to OUT:

  timings.jsonl              one line per (world size, rank, step)
  state-rank-{r}.safetensors each rank's final parameters and optimizer state
                             (largest world size), compared for byte equality
  scaling.png                tokens/s against processes, with the ideal line
  manifest.json              the figures below, and lesson_notes: a paragraph
                             written from them on why N processes are or are
                             not faster here
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from . import pyplot, save_figure
from ..config import RunConfig
from ..train.run_config import run_config
from ..runtime.launch import launch
from ..train.metrics import format_table, percentile, sync_report
from ..parallel.core.sync_stats import same_state
from ..runtime.topology import Topology
from ..train.trainer import Trainer

SEED = 35000
SYNC_KEYS = ("allreduce_inflight_s", "overlap", "sync_exposed_s", "compute_and_sync_s")


@dataclass
class ScalingOptions:
    out: str = "runs/scaling"
    steps: int = 100
    max_procs: int = 2
    preset: str = "tiny"
    batch_size: int = 4


def scaling_config(opts: ScalingOptions, world: int) -> RunConfig:
    return run_config(cli_values={
        "model.preset": opts.preset, "train.steps": opts.steps, "train.batch_size": opts.batch_size,
        "train.seed": SEED, "train.zero": 0, "train.log_every": 0, "ddp.mode": "bucketed",
        "dist.nproc": world, "dist.backend": "gloo", "out": opts.out,
    })


def scaling_worker(topo: Topology, cfg: RunConfig) -> dict:
    with Trainer(cfg, topo) as trainer:
        rows = []
        for step in range(1, cfg.train.steps + 1):
            r = trainer.train_step(measure_sync=step % 2 == 0)  # same on every rank: barriers stay matched
            rows.append({"world_size": topo.world_size, "rank": topo.rank, "step": r.step, "loss": r.loss,
                         "bracketed": r.step % 2 == 0, "step_time_s": r.step_time_s, "tokens": r.tokens,
                         "tokens_per_s": r.tokens_per_s, **{k: r.sync.get(k) for k in SYNC_KEYS}})
        return {"rows": rows, "state": trainer.strategy.state_snapshot(), "params": trainer.strategy.flat.numel}


def summarize(rows: list[dict], warmup: int) -> dict:
    """Post-warmup medians of rank 0: step time and throughput from the untouched (odd) steps,
    the compute / exposed-sync split from the barrier-bracketed (even) ones."""
    mine = [r for r in rows if r["rank"] == 0 and r["step"] > warmup]
    plain = [r for r in mine if not r["bracketed"]]
    bracketed = [r for r in mine if r["bracketed"]]
    step = statistics.median(r["step_time_s"] for r in plain)
    exposed = statistics.median(r["sync_exposed_s"] for r in bracketed)
    compute = statistics.median(r["compute_and_sync_s"] - r["sync_exposed_s"] for r in bracketed)
    allreduce = [1000 * r["allreduce_inflight_s"] for r in mine]
    overlaps = [r["overlap"] for r in mine if r["overlap"] is not None]
    return {"steps_measured": len(mine), "step_ms_p50": 1000 * step, "compute_ms_p50": 1000 * compute,
            "sync_exposed_ms_p50": 1000 * exposed, "allreduce_p50_ms": percentile(allreduce, 50),
            "allreduce_p95_ms": percentile(allreduce, 95), "overlap_mean": statistics.mean(overlaps) if overlaps else None,
            "tokens_per_sec": plain[0]["tokens"] / step,
            "sync": sync_report([r for r in mine if r["bracketed"]], 0)}


def lesson_notes(per_world: dict[int, dict], params: int) -> str:
    one, two = per_world[1], per_world[2]
    speedup = two["tokens_per_sec"] / one["tokens_per_sec"]
    efficiency = speedup / 2
    comm_share = two["sync_exposed_ms_p50"] / two["step_ms_p50"]
    overlap = two["overlap_mean"] or 0.0
    text = (f"With 2 processes the run reached {two['tokens_per_sec']:,.0f} tokens/s against "
            f"{one['tokens_per_sec']:,.0f} with 1: {speedup:.2f}x, a scaling efficiency of {efficiency:.0%}. "
            f"A 2-process step took {two['step_ms_p50']:.1f} ms (median): {two['compute_ms_p50']:.1f} ms of forward "
            f"and backward, {two['sync_exposed_ms_p50']:.1f} ms ({comm_share:.0%} of the step) waiting for gradient "
            f"all-reduces that backward did not hide (on average {overlap:.0%} of all-reduce time overlapped "
            f"backward), the rest optimizer and bookkeeping. Reducing {4 * params / 1e3:,.0f} KB of gradients took "
            f"{two['allreduce_p50_ms']:.1f} ms p50 / {two['allreduce_p95_ms']:.1f} ms p95 in flight, while one "
            f"process computes a whole step in {one['compute_ms_p50']:.1f} ms. ")
    if efficiency < 0.5:
        text += ("Communication dominates: each process has too little computation per step to pay for a "
                 "collective's fixed latency, so adding a process makes training slower, not faster. "
                 "A model with more compute per parameter synced (wider, longer sequences, larger batches) "
                 "tips the balance.")
    elif efficiency < 0.85:
        text += ("Communication is a large share of each step, so the second process helps only partly; "
                 "more compute per step, or more of the all-reduce hidden behind backward, would close the gap.")
    else:
        text += "Computation dominates each step, so the second process nearly doubles throughput."
    cores = os.cpu_count() or 1
    biggest = max(per_world)
    if biggest > cores:
        text += (f" At {biggest} processes this {cores}-core machine is oversubscribed (one thread per rank), "
                 "so those ranks also compete for cores.")
    return text


def plot(per_world: dict[int, dict], path: Path) -> None:
    plt = pyplot("bench scaling")
    worlds = sorted(per_world)
    measured = [per_world[w]["tokens_per_sec"] for w in worlds]
    fig, ax = plt.subplots(figsize=(5, 3.6), dpi=120)
    ax.plot(worlds, [measured[0] * w for w in worlds], "--", color="gray", label="ideal (linear)")
    ax.plot(worlds, measured, "o-", label="measured")
    ax.set_xlabel("processes")
    ax.set_ylabel("tokens / s")
    ax.set_xticks(worlds)
    ax.set_title("Data-parallel scaling (gloo, CPU)")
    ax.legend()
    save_figure(fig, path)


def run_scaling(opts: ScalingOptions) -> int:
    pyplot("bench scaling (scaling.png)")
    worlds = [w for w in (1, 2, 4) if w <= opts.max_procs]
    configs = {w: scaling_config(opts, w) for w in worlds}  # validates before anything runs
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    warmup = min(6, opts.steps // 5)
    per_world, rows, states = {}, [], []
    for world in worlds:
        print(f"bench scaling: {world} process(es), {opts.steps} steps ...", flush=True)
        results = launch(scaling_worker, world, configs[world], backend="gloo")
        world_rows = [row for r in results for row in r["rows"]]
        rows += world_rows
        per_world[world] = summarize(world_rows, warmup)
        states, params = [r["state"] for r in results], results[0]["params"]
    with open(out / "timings.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for rank, state in enumerate(states):
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"state-rank-{rank}.safetensors"))
    reloaded = [load_file(str(out / f"state-rank-{rank}.safetensors")) for rank in range(len(states))]
    max_diff = max(float((s[k].double() - reloaded[0][k].double()).abs().max()) for s in reloaded for k in s)
    bit_equal = all(same_state(s, reloaded[0]) for s in reloaded)
    plot(per_world, out / "scaling.png")
    manifest = {
        "seed": SEED, "backend": "gloo", "world_size": max(worlds), "model_params": params, "steps": opts.steps,
        "warmup_steps_excluded": warmup, "preset": opts.preset, "batch_size_per_rank": opts.batch_size,
        "data_order": f"one permutation per epoch seeded ({SEED}, epoch); rank r takes positions r mod N, "
                      "so shards are disjoint",
        "allreduce_p50_ms": per_world[2]["allreduce_p50_ms"], "allreduce_p95_ms": per_world[2]["allreduce_p95_ms"],
        **{f"tokens_per_sec_{w}proc": per_world[w]["tokens_per_sec"] for w in worlds},
        "byte_equivalent": {"equal": bit_equal, "max_abs_diff": max_diff, "ranks_compared": len(reloaded),
                            "world_size": max(worlds)},
        "per_world": {str(w): per_world[w] for w in worlds},
        "lesson_notes": lesson_notes(per_world, params),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    table = [[w, f"{s['tokens_per_sec']:,.0f}", f"{s['tokens_per_sec'] / (per_world[1]['tokens_per_sec'] * w):.0%}",
              f"{s['step_ms_p50']:.1f}", f"{s['compute_ms_p50']:.1f}", f"{s['sync_exposed_ms_p50']:.1f}",
              f"{s['allreduce_p50_ms']:.1f}", "-" if s["overlap_mean"] is None else f"{s['overlap_mean']:.0%}"]
             for w, s in per_world.items()]
    print(format_table(["procs", "tokens/s", "efficiency", "step_ms", "compute_ms", "sync_exposed_ms",
                        "allreduce_p50_ms", "overlap"], table))
    print(f"\n{manifest['lesson_notes']}\n")
    print(f"ranks byte-equivalent: {manifest['byte_equivalent']['equal']} (max |diff| {max_diff:g}); "
          f"wrote {out}/timings.jsonl, state-rank-*.safetensors, scaling.png, manifest.json")
    return 0
