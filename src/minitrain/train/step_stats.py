"""The step boundary: what each rank contributes to the step's one statistics exchange (RankStats, packed into one
float64 row and read back by name), what the run loop asks of a step (StepRequests), and what every rank agrees
on once the rows are exchanged (Agreed).

One exchange per step carries everything the ranks must agree on (the stop signal, the background save's
progress, rank 0's save clock) beside the figures logged, so a step costs one small all-gather and one read of the
device.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..checkpoint import AsyncSave
from ..checkpoint.remote import Upload
from ..parallel.core.memory_math import MEMORY_KINDS
from ..runtime.signals import StopRequest

PEAK_KINDS = (*MEMORY_KINDS, "total", "device")


@dataclass
class RankStats:
    """One rank's row. A field may be a float, a list of floats (its width in WIDTHS) or, when packing, a 0-dim
    tensor on the device (read back only by the exchange, so the step never waits on the device before it)."""

    loss: float | torch.Tensor  # this rank's mean loss over its micro-batches (0 where it holds none)
    holds_loss: float  # 1 where this rank computes the loss (every rank, or a pipeline's last stage), else 0
    param_norm: float | torch.Tensor
    grad_norm: float | torch.Tensor  # global: the same on every rank (not finite: the step was skipped)
    bubble: float  # this rank's measured pipeline bubble (0 without a pipeline)
    in_flight: float  # ...and the most micro-batches it held at once
    at_rest: list[float]  # bytes held between steps, by MEMORY_KINDS
    peak: list[float]  # the most bytes held during the step, by PEAK_KINDS
    stop_signal: float  # a stop signal this rank received (its number), else 0
    save_written: float  # 1 when this rank's background work (a save's write, or its upload) is done, else 0
    # --ckpt.every_minutes: the number of saves made so far when this rank's clock found the next one due, else -1
    # (rank 0's decides; the count tells a reading taken before a save from one taken after it).
    save_clock: float
    busy_s: float  # this rank's busy seconds in the step (trainer.py: a straggler's is the largest)
    # A mixture of experts: the router's auxiliary losses as the gradient carries them, summed over the MoE layers,
    # per micro-batch (0 for a dense model)
    router_loss: float | torch.Tensor = 0.0
    # A mixture of experts: per MoE layer, the slots each expert received on this rank and the slots dropped
    # (E + 1 values a layer); empty for a dense model. Last: it takes the rest of the row.
    expert_load: list[float] = dataclasses.field(default_factory=list)

    WIDTHS = {"at_rest": len(MEMORY_KINDS), "peak": len(PEAK_KINDS)}  # the list fields' lengths

    def pack(self, device: torch.device) -> torch.Tensor:
        """The row, in field order, on `device`: the host values in one copy, the device ones put in place there."""
        host, on_device = [], []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                on_device.append((len(host), value))
                host.append(0.0)
            elif f.name == "expert_load":
                host.extend(float(v) for v in value)
            elif f.name in self.WIDTHS:
                if len(value) != self.WIDTHS[f.name]:
                    raise ValueError(f"RankStats.{f.name} has {len(value)} values, not {self.WIDTHS[f.name]}")
                host.extend(float(v) for v in value)
            else:
                host.append(float(value))
        row = torch.tensor(host, dtype=torch.float64)
        # To a GPU from pinned memory without blocking: a copy from pageable memory waits for the whole stream.
        row = row.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else row.to(device)
        for at, value in on_device:
            row[at] = value.reshape(())  # a copy on the device: nothing read back
        return row

    @classmethod
    def unpack(cls, row: list[float]) -> RankStats:
        """The fields of a row pack() made, by name."""
        values, at = {}, 0
        for f in dataclasses.fields(cls):
            if f.name == "expert_load":
                values[f.name], at = list(row[at:]), len(row)
                continue
            width = cls.WIDTHS.get(f.name)
            values[f.name] = row[at] if width is None else list(row[at:at + width])
            at += 1 if width is None else width
        if at != len(row):
            raise ValueError(f"a statistics row of {len(row)} values, RankStats packs {at}")
        return cls(**values)


@dataclass(frozen=True)
class StepRequests:
    """What the run loop asks of a step, passed in (never written into the trainer): where to read this rank's
    state at the boundary, which the step's exchange shares with every rank. Read at the exchange, not when the
    step starts: a signal received, or a background write finished, during the step counts at this step."""

    stop: StopRequest | None = None  # the run's stop-signal handler (which signal this rank received, if any)
    pending_save: AsyncSave | Upload | None = None  # this rank's background save (or its upload) in flight, if any
    save_clock: Callable[[], int] | None = None  # the save cadence's clock reading (loop.SaveCadence.clock), if timed

    def stop_signal(self) -> int:
        return self.stop.signum if self.stop is not None else 0

    def save_written(self) -> bool:
        return self.pending_save is not None and self.pending_save.written

    def clock_reading(self) -> int:
        return self.save_clock() if self.save_clock is not None else -1


@dataclass(frozen=True)
class Agreed:
    """What every rank knows after a step's exchange, the same everywhere."""

    stop_signal: int = 0  # the largest signal number any rank received, else 0
    stop_ranks: tuple[int, ...] = ()  # the ranks that received one
    save_written: bool = False  # every rank's background write or upload has finished (or failed): commit it now
    save_clock: int = -1  # rank 0's save clock: the saves made so far when it found the next one due, else -1

    @classmethod
    def of(cls, rows: list[RankStats]) -> Agreed:
        signals = [int(r.stop_signal) for r in rows]
        return cls(max(signals), tuple(rank for rank, signum in enumerate(signals) if signum),
                   all(r.save_written == 1 for r in rows), int(rows[0].save_clock))
