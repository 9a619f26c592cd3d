"""Summaries the benchmarks share: a figure over repeats as (median, min, max)."""
from __future__ import annotations

import statistics


def median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def fmt_range(stats: tuple[float, float, float], pattern: str) -> str:
    """'median [min-max]' with each number formatted by pattern."""
    median, low, high = stats
    return f"{pattern.format(median)} [{pattern.format(low)}-{pattern.format(high)}]"
