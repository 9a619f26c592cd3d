"""Where a step's time goes: data, forward, backward, exposed communication, optimizer, the rest.

Phases are code regions of the step, timed with CUDA events on a GPU (the host returns from a
kernel launch long before the kernel ends, so host clocks would charge a phase's work to whatever
waits next) and with the host clock elsewhere:
- data: taking the batch and moving it to the device;
- forward, backward: the model's passes (ZeRO-3's parameter gathers and tensor-parallel
  all-reduces happen inside them and are counted there);
- comm: communication left exposed: waiting after backward for the gradient sync, plus the
  blocking collectives of the update (the gradient-norm all-reduce, ZeRO's parameter gathers);
- optimizer: the update without those collectives (norm, clipping, Adam);
- other: the rest of the step (zeroing gradients, the statistics exchange, bookkeeping).
A pipelined step runs forward and backward interleaved across micro-batches: its passes are
reported as one "forward_backward" phase.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

PHASES = ("data", "forward", "backward", "forward_backward", "comm", "optimizer", "other")


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spans: dict[str, list] = {}
        self._moved: dict[str, float] = {}

    def start(self) -> None:
        self._spans = {name: [] for name in PHASES}
        self._moved = dict.fromkeys(PHASES, 0.0)

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as `name`; under torch.profiler it shows as "minitrain.<name>" (--train.profile_steps)."""
        begin = self._mark()
        # A label costs time at every phase even with no profiler running: only under one.
        label = (torch.profiler.record_function(f"minitrain.{name}") if torch._C._autograd._profiler_enabled()
                 else contextlib.nullcontext())
        try:
            with label:
                yield
        finally:
            self._spans[name].append((begin, self._mark()))

    def move(self, seconds: float, source: str, target: str) -> None:
        """Re-attribute `seconds` measured inside `source` to `target` (collectives inside the update)."""
        self._moved[source] -= seconds
        self._moved[target] += seconds

    def finish(self, step_seconds: float) -> dict[str, float | None]:
        """Seconds per phase (None: the phase has no region in this kind of step) and the step's rest."""
        if self.cuda:  # this step's marks only (the exchange has waited for them): the next step may be running
            for spans in self._spans.values():
                for _, end in spans:
                    end.synchronize()
        out = {}
        for name, spans in self._spans.items():
            if name == "other":
                continue
            if not spans and not self._moved[name]:
                out[name] = None
                continue
            measured = sum(begin.elapsed_time(end) / 1000 if self.cuda else end - begin for begin, end in spans)
            out[name] = max(0.0, measured + self._moved[name])
        out["other"] = max(0.0, step_seconds - sum(v for v in out.values() if v is not None))
        return out


class StepProfiler:
    """--train.profile_steps A:B: torch.profiler records steps A to B on every rank and writes one trace per
    rank into `directory` when step B ends (or the run does): rank<r>.<time>.pt.trace.json, which
    chrome://tracing and ui.perfetto.dev open and TensorBoard's profile plugin lists."""

    def __init__(self, steps: tuple[int, int] | None, directory: Path, rank: int, device: torch.device):
        self.steps, self.directory, self.rank, self.device = steps, directory, rank, device
        self._profile = None
        self.written: Path | None = None

    def before_step(self, step: int) -> None:
        """Call with the number of the step about to run (1-based)."""
        if self.steps is None or step != self.steps[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.directory.mkdir(parents=True, exist_ok=True)
        handler = torch.profiler.tensorboard_trace_handler(str(self.directory), worker_name=f"rank{self.rank}")
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True, on_trace_ready=handler)
        self._profile.start()

    def after_step(self, step: int) -> None:
        if self._profile is not None and step >= self.steps[1]:
            self.stop()

    def stop(self) -> None:
        if self._profile is None:
            return
        self._profile.stop()  # calls the handler, which writes the trace
        self._profile = None
        traces = sorted(self.directory.glob(f"rank{self.rank}.*.pt.trace.json"), key=lambda p: p.stat().st_mtime)
        self.written = traces[-1] if traces else None
