"""fp16 loss scaling for a model prepared with precision="fp16", called as torch.amp.GradScaler is:

    model, optimizer = minitrain.prepare(model, optimizer_fn, precision="fp16", zero=2)
    scaler = minitrain.GradScaler(optimizer)
    for x, y in batches:
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.unscale_(optimizer)                    # optional, before a clip
        minitrain.clip_grad_norm_(model, 1.0)         # the unscaled global norm
        scaler.step(optimizer)                        # skipped on every rank if any gradient overflowed
        scaler.update()
        optimizer.zero_grad()

The policy is torch's (and the CLI's, precision.LossScaler): the scale halves after a step whose gradients
overflowed (that step is skipped: parameters and optimizer state unchanged), and doubles after
`growth_interval` clean steps. The decision uses the global gradient norm every rank already computes, so
every rank skips alike. The scale is a power of two, so scaling and unscaling change no bit of a gradient
that neither overflows nor underflows. Its state is saved by minitrain.save_checkpoint and restored by
load_checkpoint (also when the scaler is made after the load).
"""
from __future__ import annotations

import math

import torch

from ..parallel.core.loss_scale import LossScaler


class GradScaler:
    def __init__(self, optimizer, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        prepared = getattr(optimizer, "_prepared", None)
        if prepared is None:
            raise ValueError("GradScaler takes the optimizer minitrain.prepare returned")
        if prepared.settings["precision"] != "fp16":
            raise ValueError(f"GradScaler is for precision='fp16'; this model was prepared with "
                             f"{prepared.settings['precision']!r}, which needs no loss scaling")
        if prepared.scaler is not None:
            raise ValueError("this optimizer has a GradScaler already; make one per prepared model")
        if not (init_scale > 0 and math.log2(init_scale).is_integer()):
            raise ValueError(f"init_scale must be a power of two (so scaling changes no bit), got {init_scale}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval!r}")
        self._optimizer, self._prepared = optimizer, prepared
        self._scaler = LossScaler(init_scale, growth_interval)
        if prepared.scaler_state is not None:  # a checkpoint was loaded before this scaler was made
            self._scaler.load_state(prepared.scaler_state)
        self._unscaled = False  # this step's gradients were divided by the scale already (unscale_)
        self._stepped: float | None = None  # the last step's gradient norm, until update()
        prepared.scaler = self

    def get_scale(self) -> float:
        return self._scaler.scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss times the current scale: what backward runs on."""
        return loss * self._scaler.scale

    def loss_scale(self) -> float:
        """What this step's gradients are still multiplied by (1 once unscale_ divided them)."""
        return 1.0 if self._unscaled else self._scaler.scale

    def unscale_(self, optimizer) -> None:
        """Divide this step's (synced) gradients by the scale now, as torch's unscale_ does before a clip. Optional:
        step() unscales them otherwise. Collective where the sync is."""
        self._check(optimizer)
        if not self._unscaled:
            self._prepared.strategy.unscale_grads(self._scaler.scale)
            self._unscaled = True

    def step(self, optimizer) -> None:
        """optimizer.step() on the unscaled gradients, skipped on every rank if any of them is not finite."""
        self._check(optimizer)
        self._stepped = optimizer._step(self.loss_scale())
        self._unscaled = False

    def update(self) -> None:
        """Halve the scale after an overflowed (skipped) step; double it after growth_interval clean ones."""
        if self._stepped is None:
            raise RuntimeError("GradScaler.update() comes after scaler.step(optimizer)")
        self._scaler.update(overflowed=not math.isfinite(self._stepped))
        self._stepped = None

    def state_dict(self) -> dict:
        return self._scaler.state()

    def load_state_dict(self, state: dict) -> None:
        self._scaler.load_state(state)

    def _check(self, optimizer) -> None:
        if optimizer is not self._optimizer:
            raise ValueError("this GradScaler belongs to another prepared optimizer")
