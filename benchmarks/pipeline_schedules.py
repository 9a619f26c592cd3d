"""The pipeline bubble of 1F1B, interleaved (2 chunks per rank) and zero-bubble (ZB-H1), measured, against the
formulas.

For --pp 2 and 4, each schedule trains the `small` preset with 8 blocks (d_model 256, 8 heads, seq 128) split into
pp stages, a batch of 8 sequences cut into --microbatches micro-batches, float32, one rank per stage. The executor
measures each stage's bubble (1 - its busy time / the span of the whole schedule, barrier to barrier) and the
seconds of its F, B and W actions. Reported per schedule: the worst stage's measured bubble (median over steps after
warm-up), the formula with ideal equal costs ((P-1)/(M+P-1) for 1F1B; (P-1)/(VM+P-1) interleaved; (P-1)/(3M+P-1) for
zero-bubble, F = B = W),
the zero-bubble formula at the F, B and W seconds measured ((P-1)(F+B-W) / (M(F+B+W) + (P-1)(F+B-W))), and the step's
forward + backward time. Figures are median [min-max] over repeats, each repeat running the schedules in turn.

PyTorch's `torch.distributed.pipelining` has no zero-bubble schedule of one stage per rank (its
`ScheduleInterleavedZeroBubble` and `ScheduleZBVZeroBubble` hold two or more per rank), so the comparison is with
minitrain's own 1F1B, whose step time against `Schedule1F1B` is benchmarks/pipeline.py's.

    .venv/bin/python benchmarks/pipeline_schedules.py [--pps 2 4] [--microbatches 8] [--steps 6] [--repeats 2]

Writes benchmarks/results/pipeline_schedules.json (or --out).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.parallel.pipeline_parallel.schedules import expected_bubble
from minitrain.runtime.launch import launch
from minitrain.train.metrics import format_table
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

SCHEDULES = ("1f1b", "interleaved", "zero-bubble")
VIRTUAL = 2  # the interleaved schedule's chunks per rank
WARMUP = 2


def worker(topo, pp: int, microbatches: int, schedule: str, steps: int) -> dict:
    cfg = run_config(cli_values={"model.preset": "small", "model.n_layer": 8, "train.batch_size": 8,
                                 "dist.nproc": topo.world_size, "dist.pp": pp, "dist.microbatches": microbatches,
                                 "dist.schedule": schedule,
                                 "dist.virtual_stages": VIRTUAL if schedule == "interleaved" else 1,
                                 "data.synthetic_tokens": 1 << 18, "train.log_every": 0,
                                 "train.steps": steps + WARMUP})
    bubbles, kinds, spans = [], [], []
    with Trainer(cfg, topo.with_layout(1, pp)) as trainer:
        for step in range(steps + WARMUP):
            record = trainer.train_step()
            measured = trainer.pipeline.measured
            if step >= WARMUP:
                bubbles.append(max(record.pipeline["bubble"]))  # the worst stage's
                kinds.append(measured["seconds_by_kind"])
                spans.append(measured["span_s"])
    per_kind = {k: statistics.median(d[k] for d in kinds) / microbatches for k in kinds[0]}
    return {"bubble": statistics.median(bubbles), "span_s": statistics.median(spans), "seconds_per_action": per_kind}


def zero_bubble_at(seconds: dict, pp: int, microbatches: int) -> float:
    """(P-1)(F+B-W) / (M(F+B+W) + (P-1)(F+B-W)) at measured seconds per action."""
    f, b, w = seconds["F"], seconds["B"], seconds["W"]
    idle = (pp - 1) * (f + b - w)
    return idle / (microbatches * (f + b + w) + idle)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "pipeline_schedules.json"), help="the result file")
    args = parser.parse_args(argv)
    M, results, rows = args.microbatches, {}, []
    for pp in args.pps:
        runs = []
        for r in range(args.repeats):
            order = SCHEDULES[r % 3:] + SCHEDULES[:r % 3]
            runs.append({s: launch(worker, pp, pp, M, s, args.steps, backend="gloo", timeout_s=1800)[0]
                         for s in order})
            print(f"pp {pp} repeat {r + 1}: " + ", ".join(f"{s} bubble {v['bubble']:.1%} span {1000 * v['span_s']:.0f} ms"
                                                        for s, v in runs[-1].items()), file=sys.stderr, flush=True)
        results[str(pp)] = {}
        for s in SCHEDULES:
            entry = {"bubble": median_range([run[s]["bubble"] for run in runs]),
                     "span_ms": median_range([1000 * run[s]["span_s"] for run in runs]),
                     "vs_1f1b": median_range([run[s]["span_s"] / run["1f1b"]["span_s"] for run in runs]),
                     "formula": expected_bubble(pp, M, s, VIRTUAL if s == "interleaved" else 1),
                     "seconds_per_action": runs[0][s]["seconds_per_action"]}
            if s == "zero-bubble":
                entry["formula_at_measured_costs"] = median_range(
                    [zero_bubble_at(run[s]["seconds_per_action"], pp, M) for run in runs])
            results[str(pp)][s] = entry
            rows.append([pp, s, fmt_range(entry["bubble"], "{:.3f}"), f"{entry['formula']:.3f}",
                         fmt_range(entry["formula_at_measured_costs"], "{:.3f}") if s == "zero-bubble" else "",
                         f"{entry['span_ms'][0]:.0f}", fmt_range(entry["vs_1f1b"], "{:.2f}")])
    out = write_result(args.out, __file__, argv,
                       {"preset": "small", "layers": 8, "virtual_stages": VIRTUAL, "batch": 8, "microbatches": M, "steps": args.steps, "warmup": WARMUP,
                        "repeats": args.repeats, "format": "[median, min, max] over repeats", "results": results})
    print(format_table(["pp", "schedule", "bubble measured", "formula (equal costs)", "formula (measured costs)",
                        "step ms", "vs 1f1b"], rows, "><>>>>>"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
