"""One process: minitrain's trainer against the best plain PyTorch loop on the same model, tokens/s and MFU.

Runs `minitrain bench throughput` (minitrain/bench/throughput.py: the peer loop, the alternation in
rounds, the MFU formula) for each configuration below, in this one process, with the threads torch
uses by default here, and records every figure. On a CPU the MFU peak is one measured matrix
multiply; on a GPU the data sheet's dense bf16 peak.

    .venv/bin/python benchmarks/throughput.py [--configs small/fp32 small/bf16 tiny/fp32] [--rounds 5] [--out FILE]

Writes benchmarks/results/throughput.json (or --out: command, machine, every figure) and prints the table.
"""
from __future__ import annotations

import argparse

import torch
from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.bench.throughput import ThroughputOptions, device_name, measure
from minitrain.train.metrics import format_table

CONFIGS = ["small/fp32", "small/bf16", "tiny/fp32"]
# Per configuration: steps per side and round (enough for a measurable span: tiny's step is a few ms), batch,
# warm-up steps. A CPU without bf16 matrix units multiplies bf16 at ~1/70 of its float32 rate (measured here),
# so small/bf16 runs a smaller batch and fewer steps; both sides run the same, so the ratio keeps its meaning.
SETTINGS = {"tiny/fp32": {"steps": 40}, "small/fp32": {"steps": 5}, "small/bf16": {"steps": 2, "batch_size": 2,
                                                                                   "warmup": 1}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="preset/precision pairs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--late-stats", default="auto", choices=("auto", "on", "off"),
                        help="ours: --train.late_stats (default auto: on a GPU)")
    parser.add_argument("--out", default=str(RESULTS / "throughput.json"), help="the result file")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for config in args.configs:
        preset, precision = config.split("/")
        settings = {"steps": 10, "batch_size": args.batch_size, "warmup": 3, **SETTINGS.get(config, {})}
        opts = ThroughputOptions(preset=preset, precisions=[precision], compile=args.compile, rounds=args.rounds,
                                 late_stats=args.late_stats, **settings)
        results.append(measure(opts, precision, device))
        r = results[-1]
        print(f"{config}: ours {r['tokens_per_s']:,.0f} tok/s, plain {r['plain_tokens_per_s']:,.0f}, "
              f"ratio {r['ratio']:.3f}", flush=True)
    path = write_result(args.out, __file__, argv, {"device": device_name(device), "results": results,
                                                   "format": "medians over rounds; ratio = ours / plain"})
    print(format_table(["config", "batch", "ours tok/s", "plain tok/s", "ours/plain", "ours ms", "plain ms", "MFU"],
                       [[c, r["batch_size"], f"{r['tokens_per_s']:,.0f}", f"{r['plain_tokens_per_s']:,.0f}", f"{r['ratio']:.3f}",
                         f"{r['step_ms']:.2f}", f"{r['plain_step_ms']:.2f}", f"{r['mfu']:.1%}"]
                        for c, r in zip(args.configs, results)]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
