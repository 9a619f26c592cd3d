"""Balancing a mixture of experts over the global batch or over each rank's tokens: which trains better?

`--model.moe_balance global` counts the Switch/GShard balancing loss's token fractions over every rank's tokens of
a micro-batch; `rank` over each rank's own, as Megatron-LM and DeepSpeed do by default. Qiu et al. 2025 ("Demons
in the Detail") report that the global count lets experts specialise (a rank's few tokens are often of one
domain, and balancing them forces every expert to take some) and lowers perplexity. Measured here on the shipped
prose (byte-level), the same tokens in the same order for both: a 2-layer MiniGPT with 8 experts, top 2, on 2
ranks of 4 sequences each, per seed:

- the held-out loss after the last step;
- the expert load's imbalance: per layer, the busiest expert's slots over the mean, averaged over the last
  quarter of the steps (1.0 = perfectly even);
- the global balancing loss itself (E x sum_e f_e P_e over the whole step's tokens is not logged; the imbalance
  stands for it).

    .venv/bin/python benchmarks/moe_balance.py [--steps 600] [--seeds 0 1 2] [--out FILE]

Writes benchmarks/results/moe_balance.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ranges import median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

MODEL = {"model.n_layer": 2, "model.d_model": 64, "model.n_head": 4, "model.seq_len": 64, "model.moe_experts": 8,
         "model.moe_top_k": 2, "train.batch_size": 4, "dist.nproc": 2}
BALANCES = ("global", "rank")


def run(balance: str, seed: int, steps: int, out: Path) -> dict:
    flags = [f"--{k}={v}" for k, v in MODEL.items()]
    cmd = [sys.executable, "-m", "minitrain", "train", "--corpus", "text", *flags, "--model.moe_balance", balance,
           "--seed", str(seed), "--steps", str(steps), "--eval-every", str(steps), "--train.log_every", "0",
           "--ckpt.every_steps", "0", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None][-1]
    loads = [r["expert_load"] for r in rows if "expert_load" in r][-max(1, steps // 4):]
    experts = MODEL["model.moe_experts"]
    imbalance = statistics.mean(max(layer[:experts]) / (sum(layer[:experts]) / experts)
                                for step in loads for layer in step)
    train = statistics.mean(r["loss"] for r in rows[-max(1, steps // 4):] if "loss" in r)
    return {"val_loss": val, "imbalance": imbalance, "train_loss": train}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=str(RESULTS / "moe_balance.json"), help="the result file")
    args = parser.parse_args(argv)
    per_seed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(args.seeds):
            order = BALANCES if i % 2 == 0 else BALANCES[::-1]
            per_seed[seed] = {b: run(b, seed, args.steps, Path(tmp) / f"{b}-{seed}") for b in order}
            print(f"seed {seed}: " + ", ".join(f"{b} val {per_seed[seed][b]['val_loss']:.4f} imbalance "
                                               f"{per_seed[seed][b]['imbalance']:.3f}" for b in BALANCES),
                  file=sys.stderr, flush=True)
    report = {b: {key: median_range([per_seed[s][b][key] for s in args.seeds])
                  for key in ("val_loss", "imbalance", "train_loss")} for b in BALANCES}
    report["global_minus_rank_val"] = median_range([per_seed[s]["global"]["val_loss"] - per_seed[s]["rank"]["val_loss"]
                                                    for s in args.seeds])
    write_result(args.out, __file__, argv, {"model": MODEL, "steps": args.steps, "seeds": args.seeds,
                                            "per_seed": per_seed, "results": report,
                                            "format": "each figure is [median, min, max] over seeds"})
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
