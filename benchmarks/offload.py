"""What offloading the optimizer's state costs and saves, on one rank.

For each preset and each `--train.offload` mode (none, cpu, disk) a fresh process trains in float32 and reports:
- step time: median of --steps after one warm-up step;
- anonymous memory: what the trainer adds to the process's anonymous resident memory (`RssAnon`, as the OS
  counts it: file pages the kernel can drop do not count) by the end of its steps, read after glibc has given
  its freed blocks back (`malloc_trim`), so that what is counted is what is held, not the allocator's cache;
- what `minitrain plan --offload disk` says leaves the device (master, m and v of the preset), beside the
  anonymous memory disk offload saved against none.
Ratios are to `none` measured in the same repeat; each figure is median [min-max] over repeats, every repeat
running the modes in rotated order. On a CPU-only machine `cpu` offload keeps a separate master copy in the same
memory (the path a GPU takes), so its time is the copy's cost, not a transfer's.

    .venv/bin/python benchmarks/offload.py [--presets small gpt2-124m] [--steps 3] [--repeats 2] [--out FILE]

Writes benchmarks/results/offload.json (or --out: command, machine, every figure).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
from pathlib import Path

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py
from steps import step_times  # benchmarks/steps.py

from minitrain.runtime.launch import launch
from minitrain import plan
from minitrain.train.metrics import format_table, human_bytes
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

MODES = ("none", "cpu", "disk")
BATCH = {"small": 8, "gpt2-124m": 1}


def _rss_anon() -> int:
    """RssAnon once glibc has returned the free memory it keeps (activations of the last step) to the OS."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(Path("/proc/self/status").read_text().split("RssAnon:")[1].split("kB")[0]) * 1024


def planned_offload_bytes(preset: str) -> int:
    """What `minitrain plan --preset PRESET --offload disk` (one rank, ZeRO-0, float32) puts on disk."""
    cfg = run_config(cli_values={"model.preset": preset})
    P = plan.model_params(cfg.model)
    return plan.plan(plan.PlanInput(model=cfg.model, params=P, offload="disk"))["bytes_per_rank"]["disk"]


def worker(topo, preset: str, mode: str, steps: int, out: str) -> dict:
    cfg = run_config(cli_values={"model.preset": preset, "train.batch_size": BATCH[preset], "train.steps": steps + 1,
                                 "train.log_every": 0, "train.offload": mode, "out": out, "dist.backend": "gloo"})
    before = _rss_anon()
    with Trainer(cfg, topo) as trainer:
        trainer.train_step()  # warm-up
        times = step_times(trainer, steps)
        return {"step_s": statistics.median(times), "anon_bytes": _rss_anon() - before,
                "state_bytes": 3 * 4 * trainer.strategy.optimizer.master.numel()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["small", "gpt2-124m"], choices=list(BATCH))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "offload.json"), help="the result file")
    args = parser.parse_args(argv)
    report, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="minitrain-offload-") as scratch:
        for preset in args.presets:
            runs = []
            for r in range(args.repeats):
                order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                runs.append({mode: launch(worker, 1, preset, mode, args.steps, f"{scratch}/{preset}-{mode}",
                                          backend="gloo", timeout_s=1800)[0] for mode in order})
                print(f"{preset} repeat {r + 1}: " + ", ".join(f"{m} {1000 * runs[-1][m]['step_s']:.0f} ms"
                                                               for m in MODES), file=sys.stderr, flush=True)
            report[preset] = {"state_bytes": runs[0]["none"]["state_bytes"], "modes": {},
                              "plan_disk_bytes": planned_offload_bytes(preset)}
            for mode in MODES:
                entry = {"step_ms": median_range([1000 * run[mode]["step_s"] for run in runs]),
                         "anon_bytes": median_range([run[mode]["anon_bytes"] for run in runs]),
                         "time_ratio": median_range([run[mode]["step_s"] / run["none"]["step_s"] for run in runs]),
                         "anon_saved_bytes": median_range([run["none"]["anon_bytes"] - run[mode]["anon_bytes"]
                                                           for run in runs])}
                report[preset]["modes"][mode] = entry
                rows.append([preset, mode, f"{entry['step_ms'][0]:.0f}", fmt_range(entry["time_ratio"], "{:.2f}"),
                             human_bytes(entry["anon_bytes"][0]), human_bytes(entry["anon_saved_bytes"][0]),
                             human_bytes(report[preset]["state_bytes"]),
                             human_bytes(report[preset]["plan_disk_bytes"]) if mode == "disk" else ""])
    out = write_result(args.out, __file__, argv,
                       {"steps": args.steps, "warmup": 1, "repeats": args.repeats, "batch": BATCH,
                        "format": "each figure is [median, min, max] over repeats", "results": report})
    print(format_table(["preset", "offload", "step ms", "vs none", "anon added", "anon saved", "optimizer state",
                        "plan: off the device"], rows, "<<>>>>>>"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
