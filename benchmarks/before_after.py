"""The CPU optimizer and step time of two versions of minitrain, measured in the same run.

Each repeat runs a fresh process per version, alternating which goes first; a version is a source
tree given by its `src` directory (e.g. a `git worktree` of an older commit). Each process measures,
in float32 with the threads torch uses by default here:
- optimizer_ms: one FlatAdamW step (weight decay on, gradient scaled by a clip factor) on 10.8M
  parameters, the zero_stages benchmark's model size; median of 5 after 2 warm-up;
- step_ms/<preset>: one training step of the trainer at one process (median of --steps after 3 warm-up).
Figures are medians [min-max] over repeats.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/before_after.py --before /tmp/before/src [--repeats 3] [--out FILE]

Writes benchmarks/results/before_after.json (or --out) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.train.metrics import format_table

AFTER = Path(__file__).resolve().parent.parent / "src"
PRESETS = {"tiny": 60, "small": 8}  # preset -> measured steps

WORKER = """
import json, statistics, sys, time
import torch
try:  # the layered tree
    from minitrain.train.run_config import run_config
    from minitrain.train.optim import FlatAdamW
    from minitrain.runtime.topology import Topology
    from minitrain.train.trainer import Trainer
except ImportError:  # a tree from before the layers (7caf674 and older)
    from minitrain.config import build_config as run_config
    from minitrain.optim import FlatAdamW
    from minitrain.topology import Topology
    from minitrain.trainer import Trainer

def median_ms(fn, runs, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)

n = 10_800_000
opt = FlatAdamW(torch.randn(n), [(0, n // 2)], (0.9, 0.95), 1e-8, 0.1)
grad = torch.randn(n)
out = {"optimizer_ms": median_ms(lambda: opt.step(grad, 1e-3, 0.5), 5, 2)}
for preset, steps in json.loads(sys.argv[1]).items():
    cfg = run_config(cli_values={"model.preset": preset, "train.batch_size": 8, "train.steps": steps + 3,
                                   "train.log_every": 0})
    trainer = Trainer(cfg, Topology.single())
    out[f"step_ms/{preset}"] = median_ms(trainer.train_step, steps, 3)
print(json.dumps(out))
"""


def measure(src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(PRESETS)], env=env, capture_output=True,
                          text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the older version's src directory")
    parser.add_argument("--before-label", default="before", help="what the older version is (e.g. a commit)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "before_after.json"), help="the result file")
    args = parser.parse_args(argv)
    versions = [("before", Path(args.before).resolve()), ("after", AFTER)]
    runs = []
    for r in range(args.repeats):
        run = {}
        for label, src in (versions if r % 2 == 0 else versions[::-1]):
            run[label] = measure(src)
        runs.append(run)
        print(f"repeat {r + 1}: {json.dumps(run)}", file=sys.stderr, flush=True)
    results = {metric: {label: median_range([run[label][metric] for run in runs]) for label, _ in versions}
               | {"ratio": median_range([run["after"][metric] / run["before"][metric] for run in runs])}
               for metric in runs[0]["after"]}
    path = write_result(args.out, __file__, argv, {"before": args.before_label, "repeats": args.repeats,
                                                   "format": "[median, min, max] over repeats; ratio = after / before",
                                                   "results": results})
    print(format_table(["metric", "before ms", "after ms", "after / before"],
                       [[m, fmt_range(r["before"], "{:.1f}"), fmt_range(r["after"], "{:.1f}"),
                         fmt_range(r["ratio"], "{:.2f}")] for m, r in results.items()], "<>>>"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
