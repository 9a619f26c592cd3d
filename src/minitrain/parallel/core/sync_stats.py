"""A rank's gradient-sync figures for one step, from the clock marks its collectives left, and equality of
snapshots of a rank's state byte for byte."""
from __future__ import annotations

import torch


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (unlike ==, tells -0.0 from 0.0 and matches NaNs)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Two state_snapshot()s (or any tensor dicts) equal byte for byte."""
    return a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)


def sync_figures(marks: tuple, clock, wait: bool = False) -> dict | None:
    """A sync's figures from its marks (FlatStrategy.sync_at): None while a mark is not done, unless `wait`."""
    buckets, intervals, backward_end = marks
    every = [m for pair in intervals for m in pair] + ([backward_end] if backward_end is not None else [])
    for mark in every if wait else ():
        clock.wait(mark)
    if not all(clock.ready(m) for m in every):
        return None
    seconds = [(clock.seconds(a), clock.seconds(b)) for a, b in intervals]
    end = None if backward_end is None else clock.seconds(backward_end)
    return {"buckets": buckets, **sync_summary(seconds, end)}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, done in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], done))
        else:
            merged.append((start, done))
    return merged


def sync_summary(intervals: list[tuple[float, float]], backward_end: float | None) -> dict:
    """Gradient-sync figures of one step from each collective's (launched, completed) times.

    allreduce_inflight_s: wall time during which any gradient collective was in flight (the
    union of the intervals: a backend runs queued async ops one after another, so their
    intervals overlap and a plain sum would count the queueing twice). overlap: the share of
    that time before backward ended, i.e. hidden behind compute (None when backward's end is
    not observable, as inside PyTorch DDP, whose wait happens within backward)."""
    merged = _union(intervals)
    inflight = sum(done - start for start, done in merged)
    hidden = None
    if backward_end is not None and inflight > 0:
        hidden = sum(max(0.0, min(done, backward_end) - start) for start, done in merged) / inflight
    return {"allreduce_calls": len(intervals), "allreduce_inflight_s": inflight, "overlap": hidden,
            "allreduce_ms": [round(1000 * (done - start), 3) for start, done in intervals]}
