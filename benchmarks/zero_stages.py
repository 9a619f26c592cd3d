"""Step time and peak memory per rank of ZeRO stages 0-3 against PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2.

Every configuration trains the same model on the same data with the same
schedule (the peers are minitrain.bench.peers), at 2 and 4 ranks, gloo on
CPU, one thread per rank. Each repeat runs every configuration back to back
(rotated order), each in freshly launched ranks, and takes the median step
time after warmup; ratios are formed within the repeat and reported as median
[min-max] over repeats, because measurements minutes apart drift on a shared
machine.

Peak memory per rank is the most the process held during any step above what
it held before the model was built (every peer's modules already imported): on a GPU torch.cuda.max_memory_allocated,
on a CPU the resident-set high-water mark (VmHWM, reset every step). glibc is
told to return every freed block above 64 KiB to the system at once
(MALLOC_MMAP_THRESHOLD_), so the resident set follows the live tensors instead
of keeping freed memory of an earlier configuration. For our stages the
model-state peak from the strategy's ledger is reported too.

    .venv/bin/python benchmarks/zero_stages.py [--worlds 2 4] [--steps 8] [--repeats 3] [--model gpt2-124m]
                                               [--out FILE]

Writes benchmarks/results/zero_stages.json (or --out: command, machine, every figure) and prints the table.
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
from minitrain.train.memory import DevicePeak
from minitrain.train.metrics import format_table, human_bytes
from minitrain.bench.peers import PeerTrainer
from minitrain.train.trainer import Trainer

# ~10.8M parameters (43 MB in float32): model state, not activations, dominates memory.
MODEL = {"model.n_layer": 6, "model.d_model": 384, "model.n_head": 6, "model.vocab_size": 256,
         "model.seq_len": 128, "train.batch_size": 2, "data.synthetic_tokens": 1 << 18}
# --model gpt2-124m: GPT-2 small's shape (124M parameters, 2 GB of model state per rank at ZeRO-0), on 128-token
# sequences, one per rank, so that a CPU step takes seconds rather than minutes.
MODELS = {"10.8m": MODEL, "gpt2-124m": {"model.preset": "gpt2-124m", "model.seq_len": 128, "train.batch_size": 1,
                                        "data.synthetic_tokens": 1 << 16}}
CONFIGS = ["zero0", "zero1", "zero2", "zero3", "ddp", "zero-redundancy", "fsdp2-zero2", "fsdp2"]
# Each stage against PyTorch's way of sharding the same things (minitrain.bench.peers).
PEER_OF = {"zero0": "ddp", "zero1": "zero-redundancy", "zero2": "fsdp2-zero2", "zero3": "fsdp2"}
WARMUP = 2


def worker(topo, name: str, steps: int, model: dict) -> dict:
    """One configuration in fresh processes, so no earlier one's freed memory or imports are counted."""
    import torch.distributed.fsdp  # noqa: F401  every peer's modules loaded before the baseline
    import torch.distributed.optim  # noqa: F401

    stage = int(name[-1]) if name in PEER_OF else 0
    values = {**model, "train.zero": stage, "train.steps": steps, "dist.nproc": topo.world_size,
              "train.log_every": 0}
    cfg = run_config(cli_values=values)
    device = topo.device
    peak = DevicePeak(device)
    gc.collect()
    peak.reset()
    baseline = peak.bytes() if device.type != "cuda" else 0
    trainer = Trainer(cfg, topo) if name in PEER_OF else PeerTrainer(cfg, topo, name)
    times, peaks, ledger = [], [], 0
    for _ in range(steps):
        peak.reset()
        start = time.perf_counter()
        trainer.train_step()  # both end with a collective, so every rank leaves the step together
        times.append(time.perf_counter() - start)
        peaks.append(peak.bytes() - baseline)
        if name in PEER_OF:
            ledger = max(ledger, trainer.strategy.peak_memory_bytes()["total"])
    peak.close()
    return {"step_s": statistics.median(times[WARMUP:]), "peak_bytes": max(peaks), "model_state_peak": ledger}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS,
                        help="a subset to measure (ratios need the peer in the subset too)")
    parser.add_argument("--model", choices=MODELS, default="10.8m",
                        help="the 10.8M-parameter model (default) or GPT-2 small's shape on 128-token sequences")
    parser.add_argument("--out", help="the result file (default benchmarks/results/zero_stages.json, "
                                      "zero_stages_gpt2-124m.json for --model gpt2-124m)")
    args = parser.parse_args(argv)
    model = MODELS[args.model]
    args.out = args.out or str(RESULTS / ("zero_stages.json" if args.model == "10.8m" else
                                          f"zero_stages_{args.model}.json"))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # inherited by the spawned ranks
    report, rows = {}, []
    for world in args.worlds:
        runs = []
        for r in range(args.repeats):
            configs = args.configs
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            run = {}
            for name in order:
                per_rank = launch(worker, world, name, args.steps, model, backend="gloo", timeout_s=1800)
                # Slowest rank's step time; largest rank's peak.
                run[name] = {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}
            runs.append(run)
            print(f"world {world} repeat {r + 1}: " + ", ".join(
                f"{name} {1000 * run[name]['step_s']:.0f} ms" for name in configs), file=sys.stderr, flush=True)
        report[world] = {}
        for name in args.configs:
            entry = {"step_ms": median_range([1000 * run[name]["step_s"] for run in runs]),
                     "peak_bytes": median_range([run[name]["peak_bytes"] for run in runs]),
                     "model_state_peak_bytes": median_range([run[name]["model_state_peak"] for run in runs])}
            peer = PEER_OF.get(name) if PEER_OF.get(name) in args.configs else None
            if peer:
                entry["peer"] = peer
                entry["time_ratio"] = median_range([run[name]["step_s"] / run[peer]["step_s"] for run in runs])
                entry["memory_ratio"] = median_range([run[name]["peak_bytes"] / run[peer]["peak_bytes"]
                                                       for run in runs])
            report[world][name] = entry
            rows.append([world, name, f"{entry['step_ms'][0]:.0f}", human_bytes(entry["peak_bytes"][0]),
                         human_bytes(entry["model_state_peak_bytes"][0]) if peer else "",
                         peer or "", fmt_range(entry["time_ratio"], "{:.2f}") if peer else "",
                         fmt_range(entry["memory_ratio"], "{:.2f}") if peer else ""])
    out = write_result(args.out, __file__, argv, {
        "model": model, "steps": args.steps, "warmup": WARMUP, "repeats": args.repeats,
        "format": "each figure is [median, min, max] over repeats", "results": report})
    print(format_table(["ranks", "config", "step_ms", "peak/rank", "model state", "peer", "time vs peer",
                        "memory vs peer"], rows, "><>>><>>"))
    print("\npeak/rank: process high-water mark above its pre-model baseline (largest rank); model state: "
          "our ledger's peak of params + grads + optimizer; ratios median [min-max] over repeats")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
