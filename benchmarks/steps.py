"""Timing a Trainer's steps, the one way the benchmarks that drive a Trainer do it."""
from __future__ import annotations

import time


def step_times(trainer, steps: int) -> list[float]:
    """Wall-clock seconds of each of `steps` train_step() calls, in order (warm up before calling)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
    return times
