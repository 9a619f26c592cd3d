"""A mixture of experts with its experts computed where they are replicated (ep = 1) or spread by expert
parallelism (ep = 2, 4), on the same ranks, model and data.

For each world size and each ep that divides it, a fresh launch trains the `small` preset with
--model.moe_experts 8 --model.moe_top_k 2 (float32, ZeRO-0) and reports per rank 0:
- step time: median of --steps after one warm-up step;
- all-to-all share: the expert-parallel group's all-to-all seconds over the measured steps' time;
- anonymous memory: what the trainer adds to RssAnon by its last step (after malloc_trim), as the OS counts it.
Ratios are to ep = 1 at the same world size in the same repeat; figures are median [min-max] over repeats.

    .venv/bin/python benchmarks/experts.py [--worlds 2 4] [--steps 4] [--repeats 2] [--out FILE]

Writes benchmarks/results/experts.json (or --out).
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

from minitrain.runtime.comm import OpStats
from minitrain.runtime.launch import launch
from minitrain.train.metrics import format_table, human_bytes
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

EXPERTS, TOP_K, BATCH = 8, 2, 4


def _rss_anon() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(Path("/proc/self/status").read_text().split("RssAnon:")[1].split("kB")[0]) * 1024


def worker(topo, ep: int, steps: int, out: str) -> dict:
    cfg = run_config(cli_values={"model.preset": "small", "model.moe_experts": EXPERTS, "model.moe_top_k": TOP_K,
                                 "dist.nproc": topo.world_size, "dist.ep": ep, "train.batch_size": BATCH,
                                 "train.steps": steps + 1, "train.log_every": 0, "out": out})
    before = _rss_anon()
    with Trainer(cfg, topo) as trainer:
        trainer.train_step()  # warm-up
        comm_before = trainer.topo.ep.stats.get("all_to_all", OpStats()).seconds
        times = step_times(trainer, steps)
        return {"step_s": statistics.median(times),
                "all_to_all_share": (trainer.topo.ep.stats.get("all_to_all", OpStats()).seconds - comm_before) / sum(times),
                "anon_bytes": _rss_anon() - before}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "experts.json"), help="the result file")
    args = parser.parse_args(argv)
    report, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="minitrain-experts-") as scratch:
        for world in args.worlds:
            degrees = [ep for ep in (1, 2, 4, 8) if ep <= world and world % ep == 0 and EXPERTS % ep == 0]
            runs = []
            for r in range(args.repeats):
                order = degrees[r % len(degrees):] + degrees[:r % len(degrees)]
                runs.append({ep: launch(worker, world, ep, args.steps, f"{scratch}/{world}-{ep}-{r}",
                                        backend="gloo", timeout_s=1800)[0] for ep in order})
                print(f"world {world} repeat {r + 1}: " + ", ".join(f"ep {ep} {1000 * runs[-1][ep]['step_s']:.0f} ms"
                                                                     for ep in degrees), file=sys.stderr, flush=True)
            report[str(world)] = {}
            for ep in degrees:
                entry = {"step_ms": median_range([1000 * run[ep]["step_s"] for run in runs]),
                         "time_ratio": median_range([run[ep]["step_s"] / run[1]["step_s"] for run in runs]),
                         "all_to_all_share": median_range([run[ep]["all_to_all_share"] for run in runs]),
                         "anon_bytes": median_range([run[ep]["anon_bytes"] for run in runs])}
                report[str(world)][str(ep)] = entry
                rows.append([world, ep, f"{entry['step_ms'][0]:.0f}", fmt_range(entry["time_ratio"], "{:.2f}"),
                             f"{100 * entry['all_to_all_share'][0]:.0f}%", human_bytes(entry["anon_bytes"][0])])
    out = write_result(args.out, __file__, argv,
                       {"steps": args.steps, "warmup": 1, "repeats": args.repeats, "preset": "small",
                        "experts": EXPERTS, "top_k": TOP_K, "batch": BATCH,
                        "format": "each figure is [median, min, max] over repeats", "results": report})
    print(format_table(["world", "ep", "step ms", "vs ep 1", "all-to-all share", "anon added"], rows, ">>>>>>"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
