"""When things happened, on the device that did them: the clocks comm.py, the strategies and the pipeline time
their collectives and actions with.

On the CPU an operation is done when the host gets past it (gloo's async collectives finish on gloo's own
threads, which the Work's future reports), so the host's wall clock tells. On a GPU the host returns from a
kernel launch or an NCCL collective when it is queued, not when it is done: timed on the host, every
collective would take about nothing and overlap nothing. `DeviceClock` records CUDA events in the streams
instead: a mark on the compute stream where an operation is issued, and the completion of a collective as
an event on a side stream made to wait for it (so measuring it never holds the compute stream back). The
marks are read after the step's one host synchronisation (the statistics exchange), when they are done:
`ready(mark)` says whether one is, `wait(mark)` waits for it, `seconds(mark)` gives its time since the clock began.

`HostClock.mark_done(work)` returns None: the collective's completion time comes from its future's callback
(PendingCollective). Tests stand in for a GPU with a clock of their own (tests/runtime/test_gpu_paths.py).
"""
from __future__ import annotations

import time

import torch


class HostClock:
    on_device = False

    def mark(self) -> float:
        return time.perf_counter()

    def mark_done(self, _work) -> None:
        return None

    def ready(self, _mark) -> bool:
        return True

    def wait(self, _mark) -> None:
        return None

    def seconds(self, mark: float) -> float:
        return mark


class DeviceClock:
    on_device = True

    def __init__(self, device: torch.device):
        self.device = device
        self._side = torch.cuda.Stream(device)  # where collectives' completions are marked
        self._origin = self.mark()

    def mark(self) -> torch.cuda.Event:
        """An event on the current stream: it fires when the device gets there."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark_done(self, work) -> torch.cuda.Event:
        """An event that fires when `work` (an NCCL collective) completes, without holding the compute stream."""
        event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._side):
            work.wait()  # the side stream, not the compute stream, waits for the collective
            event.record(self._side)
        return event

    def ready(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def wait(self, mark: torch.cuda.Event) -> None:
        """Until the device has passed the mark (the host waits for this event only, not the whole device)."""
        mark.synchronize()

    def seconds(self, mark: torch.cuda.Event) -> float:
        return self._origin.elapsed_time(mark) / 1000


def clock_for(device: torch.device) -> HostClock | DeviceClock:
    return DeviceClock(device) if device.type == "cuda" else HostClock()
