"""The fault section: the deliberate failures that test a run's fault tolerance."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .fields import opt, require_choice, require_positive

# The deliberate failures train/faults.py knows (--fault.kind, and the kinds of --fault.plan).
FAULT_KINDS = ("", "sigkill", "sigterm", "kill-in-save", "save-error", "disk-full", "lr-spike", "nan", "slow",
               "slow-turns", "truncate-offload", "hold")


@dataclass
class FaultConfig:
    """Deliberate failures for testing fault tolerance (train/faults.py fires them)."""

    kind: str = opt("", "'' = none | sigkill | sigterm | kill-in-save | save-error | disk-full | lr-spike | nan | "
                    "slow | slow-turns | truncate-offload | hold (every rank waits at the step's start for a stop "
                    "signal); fires once (nan at every run of its step, a bad batch; "
                    "slow: every step from fault.step; slow-turns: the ranks take turns sleeping, rank r of n at "
                    "steps r, r + n, r + 2n, ...), never in a resumed run unless fault.ledger says what fired")
    step: int = opt(0, "the step at which the fault fires")
    rank: int = opt(0, "the rank it fires on (lr-spike applies on every rank)")
    plan: str = opt("", "several faults in one run: KIND@STEP[:RANK],... (e.g. 'sigkill@30:1,nan@45,disk-full@60:2'; "
                    "rank 0 if not given), each as fault.kind would fire it")
    ledger: str = opt("", "a directory where each fault that fires leaves a file first: a fault whose file is there "
                      "does not fire again, in a resumed or restarted run either (a chaos campaign's many restarts); "
                      "'' = a fault never fires in a resumed run")
    lr_multiplier: float = opt(100.0, "lr-spike: that step's learning rate is multiplied by this")
    slow_s: float = opt(0.1, "slow: seconds the rank sleeps at the start of each step")
    slow_steps: int = opt(0, "slow: how many steps the rank is slow for, from fault.step; 0 = to the end")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0


def planned_faults(f: FaultConfig) -> list[Fault]:
    """The faults of fault.kind/step/rank and of fault.plan, in that order; ConfigError naming a bad entry."""
    faults = [Fault(f.kind, f.step, f.rank)] if f.kind else []
    for entry in filter(None, (e.strip() for e in f.plan.split(","))):
        kind, _, where = entry.partition("@")
        step, _, rank = where.partition(":")
        if kind not in FAULT_KINDS[1:] or not step.isdigit() or not (rank.isdigit() or rank == ""):
            raise ConfigError(f"--fault.plan entry {entry!r}: write KIND@STEP or KIND@STEP:RANK, KIND one of "
                              f"{', '.join(FAULT_KINDS[1:])}")
        faults.append(Fault(kind, int(step), int(rank or 0)))
    return faults


def check_fault(f: FaultConfig, nproc: int) -> None:
    require_choice("fault.kind", f.kind, FAULT_KINDS)
    if not f.slow_s >= 0 or f.slow_steps < 0:
        raise ConfigError(f"fault.slow_s and fault.slow_steps must be >= 0, got {f.slow_s} and {f.slow_steps}")
    for fault in planned_faults(f):
        require_positive("fault.step", fault.step)
        if not 0 <= fault.rank < nproc:
            raise ConfigError(f"fault.rank {fault.rank} is not a rank of this run (world size {nproc})")
