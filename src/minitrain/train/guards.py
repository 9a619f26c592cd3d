"""The trainer's guards: steps whose gradients are NaN/Inf (skipped by the strategies, counted here, fatal past a
limit; fp16 overflows are the loss scaler's to handle) and loss spikes (flagged here; the run loop rolls back).

Every rank decides alike: the gradient norm and the loss they read are the same on every rank (exchanged with
the step's statistics), so a guard that stops the run stops every rank at the same step.
"""
from __future__ import annotations

import math
from collections import deque

from ..parallel.core.loss_scale import LossScaler


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with NaN/Inf gradients."""


class NonFiniteGuard:
    """Counts skipped steps: in a row (NonFiniteError past `max_in_a_row`), in all, and fp16 overflows apart."""

    def __init__(self, max_in_a_row: int, loss_scaler: LossScaler | None):
        self.max_in_a_row, self.loss_scaler = max_in_a_row, loss_scaler
        self.skipped_steps = self.skipped_in_a_row = 0
        self.overflow_steps = 0  # fp16 steps skipped because the scaled gradients overflowed

    def after_step(self, step: int, skipped: bool) -> bool:
        """Count step `step` (skipped: its gradient norm was not finite). In fp16 an overflow at a loss scale above 1
        is the scaler's to handle (it halves the scale; the step is retried with the next batch), not the guard's.
        Returns whether the step was such an overflow."""
        scaler = self.loss_scaler
        if scaler is not None:
            overflow = skipped and scaler.overflow_is_scalers()
            scaler.update(overflowed=skipped)
            if overflow:
                self.overflow_steps += 1
                return True
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.skipped_steps += skipped
        if self.skipped_in_a_row > self.max_in_a_row:
            raise NonFiniteError(f"step {step}: gradients were NaN/Inf {self.skipped_in_a_row} steps in a "
                                 f"row (more than --train.max_skipped_steps {self.max_in_a_row}); "
                                 "lower --lr, check the data, or resume from an earlier checkpoint")
        return False


class SpikeError(RuntimeError):
    """The loss spiked again after rolling back: the spike is reproducible, not transient."""


class SpikeGuard:
    """Flags a loss above `factor` x the mean of the previous `window` losses.

    Detection starts once the window is full. A spiking loss is not added to the window; the
    window is part of the checkpoint's training state, so a resumed or rolled-back run decides
    exactly as the uninterrupted one would.
    """

    def __init__(self, factor: float, window: int, history: list[float] | None = None):
        self.factor = factor
        self.losses: deque[float] = deque(history or [], maxlen=window)

    def check(self, loss: float) -> float | None:
        """The running mean if `loss` is a spike, else None (and the loss joins the window)."""
        if not math.isfinite(loss):
            return None  # a non-finite step was skipped by the NaN guard; it says nothing about the trend
        if self.factor and len(self.losses) == self.losses.maxlen:
            mean = sum(self.losses) / len(self.losses)
            if loss > self.factor * mean:
                return mean
        self.losses.append(loss)
        return None

    def state(self) -> list[float]:
        return list(self.losses)
