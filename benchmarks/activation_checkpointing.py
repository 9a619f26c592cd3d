"""What activation checkpointing saves and what it costs, on one rank.

For each mode (`none`, `block`, `selective`) a fresh process trains the `small` preset
(4 blocks, d_model 256, 8 heads, seq 128, vocab 256) with batch 8, float32, one thread, and
reports:
- stored activations: bytes autograd keeps for backward during one step, each storage once,
  parameters left out (`minitrain.train.memory.saved_activation_bytes`; exact);
- peak memory: the process's resident high-water mark during a step above its level before the
  step (glibc told to return freed blocks at once, so it follows live tensors);
- step time: median after warmup.
Ratios are to `none` measured in the same repeat; each figure is median [min-max] over repeats,
every repeat running the modes in rotated order.

    .venv/bin/python benchmarks/activation_checkpointing.py [--steps 6] [--repeats 3] [--out FILE]

Writes benchmarks/results/activation_checkpointing.json (or --out: command, machine, every figure).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py


from minitrain.train.run_config import run_config
from minitrain.runtime.launch import launch
from minitrain.train.memory import DevicePeak, saved_activation_bytes
from minitrain.train.metrics import format_table, human_bytes
from minitrain.parallel.recompute import MODES
from minitrain.train.trainer import Trainer

MODEL = {"model.preset": "small", "train.batch_size": 8, "data.synthetic_tokens": 1 << 18, "train.log_every": 0,
         "dist.backend": "gloo"}
WARMUP = 2


def worker(topo, mode: str, steps: int) -> dict:
    cfg = run_config(cli_values={**MODEL, "train.activation_checkpointing": mode, "train.steps": steps + 1})
    trainer = Trainer(cfg, topo)
    with saved_activation_bytes(trainer.model) as stored:
        trainer.train_step()  # the counting step (hooks slow it: not timed)
    peak = DevicePeak(topo.device)
    times, peaks = [], []
    for _ in range(steps):
        gc.collect()
        peak.reset()
        before = peak.bytes()
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        peaks.append(peak.bytes() - before)
    peak.close()
    return {"stored_bytes": stored["bytes"], "peak_bytes": max(peaks[WARMUP:]), "step_s": statistics.median(times[WARMUP:])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "activation_checkpointing.json"), help="the result file")
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # read by the fork server at its start
    runs = []
    for r in range(args.repeats):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        runs.append({mode: launch(worker, 1, mode, args.steps, backend="gloo", timeout_s=1800)[0] for mode in order})
        print(f"repeat {r + 1}: " + ", ".join(f"{m} {1000 * runs[-1][m]['step_s']:.0f} ms" for m in MODES),
              file=sys.stderr, flush=True)
    report, rows = {}, []
    for mode in MODES:
        entry = {key: median_range([run[mode][key] for run in runs]) for key in ("stored_bytes", "peak_bytes")}
        entry["step_ms"] = median_range([1000 * run[mode]["step_s"] for run in runs])
        for key, name in (("stored_bytes", "stored_ratio"), ("peak_bytes", "peak_ratio"), ("step_s", "time_ratio")):
            entry[name] = median_range([run[mode][key] / run["none"][key] for run in runs])
        report[mode] = entry
        rows.append([mode, human_bytes(entry["stored_bytes"][0]), fmt_range(entry["stored_ratio"], "{:.2f}"),
                     human_bytes(entry["peak_bytes"][0]), fmt_range(entry["peak_ratio"], "{:.2f}"),
                     f"{entry['step_ms'][0]:.0f}", fmt_range(entry["time_ratio"], "{:.2f}")])
    out = write_result(args.out, __file__, argv,
                       {"model": MODEL, "steps": args.steps, "warmup": WARMUP, "repeats": args.repeats,
                        "format": "each figure is [median, min, max] over repeats", "results": report})
    print(format_table(["mode", "stored activations", "vs none", "peak in step", "vs none", "step ms", "vs none"],
                       rows, "<>>>>>>"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
