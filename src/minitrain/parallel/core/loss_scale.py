"""Mixed precision's mechanics, the same for the CLI's trainer and minitrain.prepare: the 16-bit compute dtypes by
name, and fp16's dynamic loss scaling policy."""
from __future__ import annotations

import torch

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """fp16 dynamic loss scaling (the policy of torch.amp.GradScaler, held here so its state is in
    our checkpoints and its decision uses the global gradient norm every rank already has).

    Backward runs on loss * scale. A step whose global gradient norm is Inf/NaN overflowed:
    it is skipped on every rank and the scale halves. After `window` clean steps in a row the
    scale doubles, so it keeps probing for the largest scale that does not overflow. At a scale
    of 1 or less nothing is scaled up any more: non-finite gradients there are genuine, and the
    trainer's NaN guard counts them."""

    def __init__(self, init: float, window: int):
        self.scale, self.window, self.clean_steps = float(init), window, 0

    def overflow_is_scalers(self) -> bool:
        """Would a non-finite step at the current scale be an overflow the scaler handles?"""
        return self.scale > 1.0

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale, self.clean_steps = self.scale / 2, 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.scale, self.clean_steps = self.scale * 2, 0

    def state(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
