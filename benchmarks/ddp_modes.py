"""Step time of our data parallel (bucketed, naive) against PyTorch DDP, at 2 ranks.

Two models: the tiny default (communication-bound) and a compute-bound one
(the `small` preset: d_model 256, 4 layers, seq 128). One thread per rank,
gloo on CPU. Each repeat measures every configuration back to back (rotated
order, median step time after warmup) and forms ratios within the repeat; the
table shows their median and range over repeats. Reported: step time as a ratio to torch DDP measured in
the same run, and 2-vs-1 scaling efficiency = tokens/s at 2 ranks / (2 x
tokens/s of one process with the same per-rank batch). `bucketed-2mb` is ours
with 2 MiB buckets (at the default 25 MiB the compute-bound model's 13 MB of
gradients is one bucket, which cannot start before backward ends). The
machine's ceiling for that efficiency is measured too: two independent single
processes at once, no communication, against one alone.

    .venv/bin/python benchmarks/ddp_modes.py [--steps 12] [--repeats 3] [--out FILE]

Writes benchmarks/results/ddp_modes.json (or --out: command, machine, every figure) and prints the table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py


from minitrain.train.run_config import run_config
from minitrain.runtime.launch import launch
from minitrain.train.metrics import format_table
from minitrain.train.trainer import Trainer

MODELS = {"tiny": {"model.preset": "tiny", "train.batch_size": 4},
          "compute-bound": {"model.preset": "small", "train.batch_size": 4}}
MODES = {"torch": {"ddp.mode": "torch"}, "bucketed": {"ddp.mode": "bucketed"},
         "bucketed-2mb": {"ddp.mode": "bucketed", "ddp.bucket_mb": 2.0}, "naive": {"ddp.mode": "naive"}}
WARMUP = 2


def timing_worker(topo, values: dict) -> float:
    """Median step time (s) of rank 0 after warmup."""
    cfg = run_config(cli_values=values)
    trainer = Trainer(cfg, topo)
    times = [trainer.train_step().step_time_s for _ in range(cfg.train.steps)]
    return statistics.median(times[WARMUP:])


def measure(model: str, mode: str, world: int, steps: int) -> float:
    values = {**MODELS[model], **MODES[mode], "dist.nproc": world, "train.steps": steps,
              "train.log_every": 0, "dist.backend": "gloo", "data.synthetic_tokens": 1 << 18}
    return launch(timing_worker, world, values, backend="gloo")[0]


def two_at_once(model: str, steps: int) -> float:
    """Slower of two single-process runs started together: what sharing the machine costs."""
    times: list[float] = []
    runs = [threading.Thread(target=lambda: times.append(measure(model, "bucketed", 1, steps))) for _ in range(2)]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    return max(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "ddp_modes.json"), help="the result file")
    args = parser.parse_args(argv)
    report, rows = {}, []
    for model in MODELS:
        # Ratios are taken within a repeat (measurements minutes apart drift on a shared machine),
        # then summarised over repeats as median [min, max].
        runs: list[dict[str, float]] = []
        for r in range(args.repeats):
            names = list(MODES)
            order = names[r % len(names):] + names[:r % len(names)]
            run = {mode: measure(model, mode, 2, args.steps) for mode in order}
            run["single"] = measure(model, "bucketed", 1, args.steps)
            run["shared"] = two_at_once(model, args.steps)
            runs.append(run)
            print(f"{model:>13} repeat {r + 1}: " + ", ".join(f"{k} {1000 * v:.1f}" for k, v in run.items())
                  + " ms/step", file=sys.stderr, flush=True)
        report[model] = {"ceiling_2v1": median_range([run["single"] / run["shared"] for run in runs]),
                         "single_process_step_ms": median_range([1000 * run["single"] for run in runs])}
        for mode in MODES:
            entry = {"step_ms": median_range([1000 * run[mode] for run in runs]),
                     "ratio_to_torch": median_range([run[mode] / run["torch"] for run in runs]),
                     # tokens/s at 2 ranks / (2 x tokens/s of one process), same per-rank batch
                     "scaling_efficiency_2v1": median_range([run["single"] / run[mode] for run in runs])}
            report[model][mode] = entry
            rows.append([model, mode, f"{entry['step_ms'][0]:.1f}", fmt_range(entry["ratio_to_torch"], "{:.2f}"),
                         fmt_range(entry["scaling_efficiency_2v1"], "{:.0%}")])
        rows.append([model, "(machine ceiling)", "", "", fmt_range(report[model]["ceiling_2v1"], "{:.0%}")])
    out = write_result(args.out, __file__, argv, {"steps": args.steps, "repeats": args.repeats,
                                                   "format": "each figure is [median, min, max] over repeats",
                                                   "results": report})
    print(format_table(["model", "mode", "step_ms (2 ranks)", "vs torch", "2-vs-1 efficiency"], rows, "<<>>>"))
    print("\nmedian [min-max] over repeats; machine ceiling = one process alone vs. two independent ones at once")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
