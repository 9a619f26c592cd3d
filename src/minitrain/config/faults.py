"""The fault section: the deliberate failures that test a run's fault tolerance."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .fields import opt, require_choice, require_positive

# The deliberate failures train/faults.py knows (--fault.kind).
FAULT_KINDS = ("", "sigkill", "sigterm", "kill-in-save", "save-error", "lr-spike", "slow", "slow-turns",
               "truncate-offload")


@dataclass
class FaultConfig:
    """Deliberate failures for testing fault tolerance (train/faults.py fires them)."""

    kind: str = opt("", "'' = none | sigkill | sigterm | kill-in-save | save-error | lr-spike | slow | "
                    "slow-turns | truncate-offload; fires once (slow: every step from fault.step; slow-turns: the "
                    "ranks take turns sleeping, rank r of n at steps r, r + n, r + 2n, ...), never in a resumed run")
    step: int = opt(0, "the step at which the fault fires")
    rank: int = opt(0, "the rank it fires on (lr-spike applies on every rank)")
    lr_multiplier: float = opt(100.0, "lr-spike: that step's learning rate is multiplied by this")
    slow_s: float = opt(0.1, "slow: seconds the rank sleeps at the start of each step")


def check_fault(f: FaultConfig, nproc: int) -> None:
    require_choice("fault.kind", f.kind, FAULT_KINDS)
    if f.kind:
        require_positive("fault.step", f.step)
        if not f.slow_s >= 0:
            raise ConfigError(f"fault.slow_s must be >= 0, got {f.slow_s}")
        if not 0 <= f.rank < nproc:
            raise ConfigError(f"fault.rank {f.rank} is not a rank of this run (world size {nproc})")
