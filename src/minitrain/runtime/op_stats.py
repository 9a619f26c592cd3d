"""What a group's collectives cost: calls, payload bytes and seconds per op, kept by one OpLedger per Comm.

Seconds are measured between two marks of the Comm's clock (clock.py). On the host they are booked at once; on a
device the marks are CUDA events, read only once both are done (after the step's host synchronisation, all of
them), so a collective is booked when its events are, never by blocking for them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class OpLedger:
    """Per-op totals of one group's collectives, and the seconds of those recorded under a tag (a region whose
    collectives' time is wanted apart, e.g. the optimizer's update)."""

    def __init__(self):
        self.stats: dict[str, OpStats] = {}
        self._unbooked: list[tuple] = []  # (op, bytes, began, ended, tag) on a device clock, booked once done
        self._tagged: dict[str, float] = {}

    def record(self, clock, op: str, nbytes: int, began, ended, tag: str | None) -> None:
        """Book a collective between two marks of the clock: now on the host, once both are done on a device."""
        if clock.on_device:
            self._unbooked.append((op, nbytes, began, ended, tag))
        else:
            self.book(op, nbytes, ended - began, tag)

    def settle(self, clock) -> None:
        """Book the collectives whose device marks are done (after the step's host synchronisation, all of them)."""
        waiting = []
        for op, nbytes, began, ended, tag in self._unbooked:
            if clock.ready(began) and clock.ready(ended):
                self.book(op, nbytes, clock.seconds(ended) - clock.seconds(began), tag)
            else:
                waiting.append((op, nbytes, began, ended, tag))
        self._unbooked = waiting

    def book(self, op: str, nbytes: int, seconds: float, tag: str | None = None) -> None:
        stats = self.stats.setdefault(op, OpStats())
        stats.calls += 1
        stats.bytes += nbytes
        stats.seconds += seconds
        if tag is not None:
            self._tagged[tag] = self._tagged.get(tag, 0.0) + seconds

    def take_tagged(self, clock, tag: str) -> float:
        """Seconds of the collectives recorded under `tag` since the last take (booked ones only: on a device,
        read after the step's host synchronisation)."""
        if self._unbooked:
            self.settle(clock)
        return self._tagged.pop(tag, 0.0)

    def totals(self, clock) -> OpStats:
        """Sum over all ops so far (take differences for per-step figures); on a device, of those whose marks are
        done (all of them after the step's host synchronisation)."""
        if self._unbooked:
            self.settle(clock)
        return OpStats(sum(s.calls for s in self.stats.values()),
                       sum(s.bytes for s in self.stats.values()),
                       sum(s.seconds for s in self.stats.values()))
