"""Context parallelism: what each rank holds for backward as the sequence grows, at cp 1, 2 and 4, and what the
step costs by ring and by Ulysses against one rank holding the whole sequence.

Memory: for each sequence length and cp, a fresh launch of cp ranks trains the `small` preset (4 blocks, d_model
256, 8 heads) on one sequence per step (float32, ring attention) and reports rank 0's
- stored activations: bytes autograd keeps for backward in a step, each storage once, parameters left out
  (`minitrain.train.memory.saved_activation_bytes`; exact), with the planner's prediction beside it;
- allocated peak: the most bytes the CPU allocator held during a step above what it held before
  (`allocated_peak_bytes`), the block scores ring attention makes and frees included.
Time: at the longest sequence, the step of cp 1 (one rank, the fused attention kernel) against cp 2 and 4 by ring
and by Ulysses (2 and 4 ranks on this machine's cores), median of --steps after one warm-up; figures are median
[min-max] over repeats, each repeat running the layouts in rotated order.

    .venv/bin/python benchmarks/context_parallel.py [--seqs 256 512 1024 2048] [--steps 3] [--repeats 2]

Writes benchmarks/results/context_parallel.json (or --out).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py
from steps import step_times  # benchmarks/steps.py

from minitrain import plan
from minitrain.runtime.launch import launch
from minitrain.train.memory import allocated_peak_bytes, saved_activation_bytes
from minitrain.train.metrics import format_table, human_bytes
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer


def _config(world: int, seq: int, style: str, steps: int):
    return run_config(cli_values={"model.preset": "small", "model.seq_len": seq, "train.batch_size": 1,
                                  "dist.nproc": world, "dist.cp": world, "dist.cp_style": style,
                                  "data.synthetic_tokens": 1 << 20, "train.steps": steps + 2,
                                  "train.log_every": 0, "dist.backend": "gloo"})


def memory_worker(topo, seq: int) -> dict:
    cfg = _config(topo.world_size, seq, "ring", 2)
    with Trainer(cfg, topo) as trainer:
        trainer.train_step()  # warm-up: the optimizer's state exists from here on
        with saved_activation_bytes(trainer.model) as stored:
            trainer.train_step()
        gc.collect()
        peak = allocated_peak_bytes(trainer.train_step)
    predicted = plan.activation_bytes(plan.PlanInput(model=cfg.model, params=0, micro_batch=1, cp=topo.world_size,
                                                     hardware=plan.PRESETS["h100-sxm"]))
    return {"stored_bytes": stored["bytes"], "peak_bytes": peak, "predicted_bytes": predicted}


def time_worker(topo, seq: int, style: str, steps: int) -> float:
    with Trainer(_config(topo.world_size, seq, style, steps), topo) as trainer:
        trainer.train_step()
        return statistics.median(step_times(trainer, steps))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "context_parallel.json"), help="the result file")
    args = parser.parse_args(argv)
    memory = {}
    for seq in args.seqs:
        memory[str(seq)] = {str(cp): launch(memory_worker, cp, seq, backend="gloo", timeout_s=1800)[0]
                            for cp in (1, 2, 4)}
        print(f"seq {seq}: " + ", ".join(f"cp {cp} {human_bytes(m['stored_bytes'])}"
                                         for cp, m in memory[str(seq)].items()), file=sys.stderr, flush=True)
    layouts = [(1, "ring"), (2, "ring"), (2, "ulysses"), (4, "ring"), (4, "ulysses")]
    seq, runs = max(args.seqs), []
    for r in range(args.repeats):
        order = layouts[r % len(layouts):] + layouts[:r % len(layouts)]
        runs.append({f"{cp} {style}": launch(time_worker, cp, seq, style, args.steps, backend="gloo",
                                             timeout_s=1800)[0] for cp, style in order})
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {1000 * v:.0f} ms" for k, v in runs[-1].items()),
              file=sys.stderr, flush=True)
    timing = {key: {"step_ms": median_range([1000 * run[key] for run in runs]),
                    "ratio": median_range([run[key] / run["1 ring"] for run in runs])} for key in runs[0]}
    out = write_result(args.out, __file__, argv,
                       {"preset": "small", "batch": 1, "precision": "fp32", "steps": args.steps, "warmup": 1,
                        "repeats": args.repeats, "time_seq": seq,
                        "format": "timing: [median, min, max] over repeats", "memory": memory, "timing": timing})
    rows = [[seq_, cp, human_bytes(m["stored_bytes"]), f"{m['stored_bytes'] / memory[seq_]['1']['stored_bytes']:.3f}",
             human_bytes(m["predicted_bytes"]), human_bytes(m["peak_bytes"])]
            for seq_, by_cp in memory.items() for cp, m in by_cp.items()]
    print(format_table(["seq", "cp", "stored", "vs cp 1", "planned", "allocated peak"], rows, ">>>>>>"))
    print(format_table(["layout", "step ms", "vs cp 1"], [[k, f"{v['step_ms'][0]:.0f}", fmt_range(v["ratio"], "{:.2f}")]
                                                          for k, v in timing.items()], "<>>"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
