"""What ZeRO-3's check on reads of freed parameters costs a user's loop (parallel/user_loop/freed_params.py).

In a user's loop at ZeRO-3 every plain nn.Parameter becomes a Zero3Parameter, whose __torch_function__ refuses an
op that would read a freed parameter: Python work per op that receives a parameter. This measures the step time
(forward, backward, AdamW step, zero_grad) of a Hugging Face GPT-2 through `minitrain.prepare(zero=3)` in one
process, with the check and without it (the same code with the class left as it is), alternating within each
repeat; the ratio is formed within a repeat and reported as median [min-max]. Two widths: 256, and 32, where each
op is tiny, so the per-op Python work weighs most.

    .venv/bin/python benchmarks/zero3_read_guard.py [--steps 12] [--repeats 3] [--out FILE]

Writes benchmarks/results/zero3_read_guard.json (or --out) and prints the table.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

import minitrain
from minitrain.parallel import zero3
from minitrain.train.metrics import format_table

WIDTHS = {256: {"vocab": 8192, "seq": 128}, 32: {"vocab": 256, "seq": 32}}


def step_time(width: int, guarded: bool, steps: int) -> float:
    """Median step time of prepare(zero=3) on a 4-layer GPT-2 of `width`, with or without the check."""
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = WIDTHS[width]
    original = zero3.guard_freed
    zero3.guard_freed = original if guarded else (lambda params: None)
    try:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=shape["vocab"], n_embd=width, n_layer=4, n_head=4,
                                           n_positions=shape["seq"], bos_token_id=0, eos_token_id=0))
        model, opt = minitrain.prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), zero=3)
    finally:
        zero3.guard_freed = original
    ids = torch.randint(0, shape["vocab"], (4, shape["seq"]))
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - began)
    return statistics.median(times[2:])  # after two warm-up steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "zero3_read_guard.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    minitrain.init_distributed()
    rows = []
    for width in WIDTHS:
        ratios, with_check, without = [], [], []
        for repeat in range(args.repeats):
            order = (True, False) if repeat % 2 == 0 else (False, True)
            measured = {guarded: step_time(width, guarded, args.steps) for guarded in order}
            with_check.append(measured[True])
            without.append(measured[False])
            ratios.append(measured[True] / measured[False])
        rows.append({"width": width, "with_check_ms": 1000 * statistics.median(with_check),
                     "without_ms": 1000 * statistics.median(without), "ratio": median_range(ratios)})
    print(format_table(["GPT-2 width", "with the check ms", "without ms", "ratio"],
                       [[r["width"], f"{r['with_check_ms']:.1f}", f"{r['without_ms']:.1f}", fmt_range(r["ratio"], "{:.2f}")]
                        for r in rows]))
    out = write_result(args.out, __file__, argv, {"steps": args.steps, "repeats": args.repeats, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
