"""Where a one-process training step's time goes besides forward and backward: the trainer's statistics (with the
parameter norm at every step, and as `minitrain train --train.log_every 0` computes it, at the last step only)
and its update, beside the plain PyTorch loop's (minitrain/bench/throughput.py's PlainLoop) same parts.

Three sides step by turns in one process, with the threads torch uses by default here: a trainer computing the
parameter norm at every step, one computing it on none of the measured steps, and the plain loop. Each part is
timed on the host clock around its call (the CPU: nothing runs behind the host); figures are medians over the
measured steps.

    .venv/bin/python benchmarks/step_costs.py [--preset small] [--steps 30] [--out FILE]

Writes benchmarks/results/step_costs.json (or --out) and prints the table.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict

import torch
from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.bench.throughput import (
    PlainLoop,
    ThroughputOptions,
    bench_config,
    device_name,
)
from minitrain.runtime.topology import Topology
from minitrain.train.metrics import format_table
from minitrain.train.step_stats import RankStats
from minitrain.train.trainer import Trainer

# The parts timed: (name, what it is). Statistics first; "step" is the whole step.
PARTS = {
    "stats.begin": "statistics: the watch opened (clocks, collectives so far, memory peaks reset)",
    "stats.issue": "statistics: the exchange issued (memory figures, the row, the gather)",
    "stats.param_norm": "of which the parameter norm",
    "stats.pack": "of which the row packed",
    "stats.read": "statistics: the rows read back into the record",
    "zero_grad": "gradients zeroed",
    "update": "clip and update (the gradient norm, the optimizer, publishing)",
    "step": "the whole step",
}


def _timed(times: dict, key: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key].append(time.perf_counter() - start)
    return timed


def _watched_trainer(cfg, device, every: int, times: dict) -> Trainer:
    trainer = Trainer(cfg, Topology.single(device), param_norm_every=every)
    s, stats = trainer.strategy, trainer.stats
    for obj, name, key in [(stats, "begin", "stats.begin"), (stats, "issue", "stats.issue"),
                           (s, "param_norm_tensor", "stats.param_norm"), (stats, "read", "stats.read"),
                           (s, "zero_grad", "zero_grad"), (s, "step", "update"), (trainer, "launch_step", "step")]:
        setattr(obj, name, _timed(times, key, getattr(obj, name)))
    return trainer


def _watched_plain(cfg, device, times: dict) -> PlainLoop:
    """The plain loop, its update (clip_grad_norm_, timed while it steps, then AdamW) and zero_grad timed."""
    plain = PlainLoop(cfg, device)
    plain.optimizer.step = _timed(times, "update", plain.optimizer.step)
    plain.optimizer.zero_grad = _timed(times, "zero_grad", plain.optimizer.zero_grad)
    plain.train_step = _timed(times, "step", plain.train_step)
    return plain


def measure(preset: str, steps: int, warmup: int) -> dict:
    device = torch.device("cpu")
    # The bench's run: its last step is past the measured ones, so the second trainer computes no norm here.
    cfg = bench_config(ThroughputOptions(preset=preset, steps=steps + warmup, rounds=2, warmup=0), "fp32")
    sides = {"every_step": defaultdict(list), "log_steps": defaultdict(list), "plain": defaultdict(list)}
    pack = RankStats.pack
    ours = {name: _watched_trainer(cfg, device, every, sides[name]) for name, every in (("every_step", 1),
                                                                                        ("log_steps", 0))}
    plain = _watched_plain(cfg, device, sides["plain"])
    runs = [(name, t.launch_step) for name, t in ours.items()] + [("plain", plain.train_step)]
    clip = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = _timed(sides["plain"], "update.clip", clip)  # the plain loop's, by name
    try:
        for i in range(warmup + steps):
            for name, step in runs:
                RankStats.pack = _timed(sides[name], "stats.pack", pack)
                step()
            if i == warmup - 1:
                for times in sides.values():
                    times.clear()
    finally:
        RankStats.pack, torch.nn.utils.clip_grad_norm_ = pack, clip
        for t in ours.values():
            t.close()
    plain_update = [a + b for a, b in zip(sides["plain"].pop("update.clip"), sides["plain"]["update"])]
    sides["plain"]["update"] = plain_update
    figures = {name: {key: 1000 * statistics.median(values) for key, values in times.items()}
               for name, times in sides.items()}
    for name in ours:
        f = figures[name]
        f["stats"] = f["stats.begin"] + f["stats.issue"] + f["stats.read"]
        f["stats_share"] = f["stats"] / f["step"]
    return {"preset": preset, "steps": steps, "warmup": warmup, "params": ours["log_steps"].model.num_params(),
            "ms": figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "step_costs.json"), help="the result file")
    args = parser.parse_args(argv)
    result = measure(args.preset, args.steps, args.warmup)
    path = write_result(args.out, __file__, argv, {"device": device_name(torch.device("cpu")), **result,
                                                   "format": "medians over the measured steps, ms"})
    ms = result["ms"]
    rows = [[key, *(f"{ms[side][key]:.2f}" if key in ms[side] else "" for side in ms)] for key in PARTS]
    print(format_table(["part", "ours, norm every step", "ours, norm on log steps", "plain"], rows))
    print(f"statistics: {ms['every_step']['stats_share']:.2%} of the step with the norm every step, "
          f"{ms['log_steps']['stats_share']:.2%} without; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
