"""Deliberate failures, so the fault-tolerance tests exercise the real paths (`--fault.kind`, `--fault.plan`).

Each fault fires at one step, on one rank. A process fault fires once: never in a run that resumed from a
checkpoint (the restarted or resumed run must get through), or, with --fault.ledger, once across every restart
(tools/chaos.py: many faults, many restarts). A data fault (nan) is a property of its step's batch and fires
whenever that step runs, in a replay too, so a run that recomputes the step meets it as the uninterrupted run did.
Kinds:
  sigkill       the rank kills itself (SIGKILL) as the step starts
  sigterm       the rank sends itself SIGTERM as the step starts (the step finishes)
  kill-in-save  the rank is SIGKILLed in the save at that step, after its shard file is written and before the
                checkpoint is renamed into place
  save-error    the rank's shard write at that step fails (an OSError)
  disk-full     the same, as a full disk fails it (OSError ENOSPC)
  lr-spike      every rank multiplies that step's learning rate by --fault.lr_multiplier
  nan           the rank's loss at that step is NaN, so the step's gradients are: the step is skipped
  slow          the rank sleeps --fault.slow_s seconds at the start of every step from the step on, for
                --fault.slow_steps steps (0: to the end; a straggler, the one kind that fires at many steps)
  slow-turns    the ranks take turns: from the step on, rank r sleeps --fault.slow_s at the steps where
                step % world == r (a different straggler at every step: what bounded staleness absorbs)
  truncate-offload  the rank's disk-offload files are cut to half their size as the step starts (another program
                clobbering the offload directory)
  hold          every rank waits at the start of the step until the run is asked to stop (a stop signal: torchrun's
                SIGTERM when a node joins an elastic job), then takes the step and stops there: a test that needs
                the run still going when something slow happens beside it waits for that, not for wall time
"""
from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from ..config import FaultConfig  # its kinds are config.FAULT_KINDS, the ones listed above
from ..config.faults import Fault, planned_faults

EVERY_RANK = ("lr-spike", "slow-turns", "hold")  # a learning rate must agree everywhere; turns, holds everyone's
TIED_TO_STEPS = ("nan", "slow", "slow-turns")  # fire whenever their steps run, not once


class Faults:
    def __init__(self, cfg: FaultConfig, rank: int, resumed: bool, offload_files: Path | None = None,
                 world: int = 1, stop_requested: Callable[[], bool] = lambda: False):
        """offload_files: the directory of this run's disk-offload files (truncate-offload), if any. world: the
        ranks that take turns (slow-turns). stop_requested: whether a stop signal has come (what a hold waits for)."""
        self.cfg, self.rank, self.offload_files, self.world = cfg, rank, offload_files, world
        self.stop_requested = stop_requested
        self.faults = [f for f in planned_faults(cfg) if f.kind in EVERY_RANK or f.rank == rank]
        self.ledger = Path(cfg.ledger) if cfg.ledger else None
        self.resumed = resumed
        self.fired: set[Fault] = set()

    def on_resume(self) -> None:
        """The run loaded a checkpoint: without a ledger, no process fault fires from now on."""
        self.resumed = True

    def _once(self, fault: Fault) -> bool:
        """Whether a process fault may fire now, noting that it did (in the ledger first: a SIGKILL cannot lose it)."""
        if self.ledger is None:
            if self.resumed or fault in self.fired:
                return False
            self.fired.add(fault)
            return True
        self.ledger.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.ledger / f"{fault.kind}@{fault.step}:{self.rank}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def _fires(self, kinds: tuple[str, ...], step: int) -> bool:
        return any(f.kind in kinds and f.step == step and (f.kind in TIED_TO_STEPS or self._once(f))
                   for f in self.faults)

    def _slow(self, fault: Fault, step: int) -> bool:
        if fault.kind == "slow":
            return fault.step <= step and (not self.cfg.slow_steps or step < fault.step + self.cfg.slow_steps)
        return fault.kind == "slow-turns" and step >= fault.step and step % self.world == self.rank

    def at_step_start(self, step: int) -> None:
        if any(self._slow(f, step) for f in self.faults) and not (self.resumed and self.ledger is None):
            time.sleep(self.cfg.slow_s)
        if self._fires(("hold",), step):
            while not self.stop_requested():
                time.sleep(0.05)
        if self._fires(("sigkill",), step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires(("sigterm",), step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._fires(("truncate-offload",), step) and self.offload_files is not None:
            for path in self.offload_files.glob(f"rank-{self.rank:05d}-*.bin"):
                os.truncate(path, path.stat().st_size // 2)

    def lr_factor(self, step: int) -> float:
        return self.cfg.lr_multiplier if self._fires(("lr-spike",), step) else 1.0

    def loss_factor(self, step: int) -> float:
        """NaN at a nan fault's step (on its rank), else 1."""
        return float("nan") if self._fires(("nan",), step) else 1.0

    def after_shard_written(self, step: int) -> None:
        """Called by a checkpoint save (possibly from its writer thread) once the shard is on disk."""
        if self._fires(("kill-in-save",), step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires(("save-error",), step):
            raise OSError(f"injected write failure (--fault.kind save-error at step {step})")
        if self._fires(("disk-full",), step):
            raise OSError(errno.ENOSPC, f"No space left on device (injected: --fault.kind disk-full at step {step})")
