"""Ours against a PyTorch peer, step time as a ratio: the loop and the report the peer benchmarks share
(tensor_parallel.py, pipeline.py)."""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import write_result  # benchmarks/record.py

from minitrain.train.metrics import format_table


def time_steps(step: Callable, zero_grad: Callable, loader, comm, steps: int, warmup: int) -> dict:
    """Time `step(x, y)` (forward + backward; returns the loss tensor, or None on ranks without it) on
    `warmup + steps` batches, barrier to barrier over `comm`: {"step_s": median after warmup, "first_loss"}."""
    times, first_loss = [], None
    for _ in range(warmup + steps):
        x, y = loader.next_batch()
        zero_grad(set_to_none=True)
        comm.barrier()
        start = time.perf_counter()
        loss = step(x, y)
        comm.barrier()
        times.append(time.perf_counter() - start)
        if first_loss is None and loss is not None:
            loss = loss.detach()  # a DTensor loss is gathered whole (outside the timed part)
            first_loss = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    return {"step_s": statistics.median(times[warmup:]), "first_loss": first_loss}


def time_in_turn(steps_by_impl: dict[str, Callable], zero_grad: Callable, loader, comm, steps: int,
                 warmup: int) -> dict:
    """Time each impl's `step(x, y)` on the same batches in one process, in turns: every batch runs through both,
    which goes first alternating, barrier to barrier over `comm`. Whatever slows the machine for a while slows both
    alike, so their ratio is steadier than that of separate launches. Returns {impl: {"step_s": median after warmup,
    "first_loss"}, "ratio": median over batches of the first impl's time / the second's}."""
    impls = list(steps_by_impl)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    first_loss: dict[str, float | None] = dict.fromkeys(impls)
    for i in range(warmup + steps):
        x, y = loader.next_batch()
        for impl in (impls if i % 2 == 0 else impls[::-1]):
            zero_grad(set_to_none=True)
            comm.barrier()
            start = time.perf_counter()
            loss = steps_by_impl[impl](x, y)
            comm.barrier()
            times[impl].append(time.perf_counter() - start)
            if first_loss[impl] is None and loss is not None:
                first_loss[impl] = float(loss.detach())
    ours, peer = (times[impl][warmup:] for impl in impls)
    return {**{impl: {"step_s": statistics.median(times[impl][warmup:]), "first_loss": first_loss[impl]}
               for impl in impls},
            "ratio": statistics.median(a / b for a, b in zip(ours, peer))}


def compare(run_one: Callable[[str], dict], peer: str, repeats: int) -> tuple[dict, tuple[float, float, float]]:
    """run_one(impl) -> {"step_s", "first_loss"} for impl "minitrain" and `peer`. Each repeat runs both,
    alternating which goes first; the ratio is ours / the peer's within each repeat. Returns
    ({impl: {"step_ms": (median, min, max), "first_loss"}}, ratio as (median, min, max))."""
    impls = ("minitrain", peer)
    runs = []
    for r in range(repeats):
        runs.append({impl: run_one(impl) for impl in (impls if r % 2 == 0 else impls[::-1])})
        print(f"repeat {r + 1}: " + ", ".join(f"{i} {1000 * runs[-1][i]['step_s']:.0f} ms (first loss "
                                               f"{runs[-1][i]['first_loss']:.6f})" for i in impls),
              file=sys.stderr, flush=True)
    return _report(runs, impls, [run["minitrain"]["step_s"] / run[peer]["step_s"] for run in runs])


def compare_in_turn(run_both: Callable[[], dict], peer: str, repeats: int) -> tuple[dict, tuple[float, float, float]]:
    """As `compare`, but each repeat is one launch timing both in turns (`time_in_turn`, ours first in the dict); the
    ratio is the repeat's median of per-batch ratios."""
    runs = []
    for r in range(repeats):
        runs.append(run_both())
        print(f"repeat {r + 1}: " + ", ".join(f"{i} {1000 * runs[-1][i]['step_s']:.0f} ms" for i in ("minitrain", peer))
              + f", ratio {runs[-1]['ratio']:.3f}", file=sys.stderr, flush=True)
    return _report(runs, ("minitrain", peer), [run["ratio"] for run in runs])


def _report(runs: list[dict], impls: tuple[str, str], ratios: list[float]) -> tuple[dict, tuple[float, float, float]]:
    report = {impl: {"step_ms": median_range([1000 * run[impl]["step_s"] for run in runs]),
                     "first_loss": runs[0][impl]["first_loss"]} for impl in impls}
    return report, median_range(ratios)


def write_and_print(path: str | os.PathLike, script: str, argv: list[str] | None, settings: dict, report: dict, ratio: tuple,
                    title: str, peer_name: str) -> None:
    """The result file (command, machine, settings, results, ratio) and the table with the ratio line."""
    peer = next(impl for impl in report if impl != "minitrain")
    path = write_result(path, script, argv, {**settings, "format": "each figure is [median, min, max] over repeats",
                                             "results": report, f"minitrain_over_{peer}": ratio})
    rows = [[impl, fmt_range(r["step_ms"], "{:.0f}"), f"{r['first_loss']:.6f}"] for impl, r in report.items()]
    print(format_table([title, "forward+backward ms", "first loss"], rows, "<>>"))
    print(f"minitrain / {peer_name} step time: {fmt_range(ratio, '{:.2f}')}")
    print(f"wrote {path}")
