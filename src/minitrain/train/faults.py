"""Deliberate failures, so the fault-tolerance tests exercise the real paths (`--fault.kind`).

Each fault fires at most once per process, at one step, and never in a run that resumed from a
checkpoint: the restarted or resumed run must get through. Kinds:
  sigkill       rank --fault.rank kills itself (SIGKILL) as step --fault.step starts
  sigterm       rank --fault.rank sends itself SIGTERM as the step starts (the step finishes)
  kill-in-save  rank --fault.rank is SIGKILLed in the save at that step, after its shard file
                is written and before the checkpoint is renamed into place
  save-error    rank --fault.rank's shard write at that step fails (an OSError)
  lr-spike      every rank multiplies that step's learning rate by --fault.lr_multiplier
  slow          rank --fault.rank sleeps --fault.slow_s seconds at the start of every step from --fault.step on
                (a straggler: the one kind that fires more than once)
  slow-turns    the ranks take turns: from --fault.step on, rank r sleeps --fault.slow_s at the steps where
                step % world == r (a different straggler at every step: what bounded staleness absorbs)
  truncate-offload  rank --fault.rank's disk-offload files are cut to half their size as the step starts (another
                program clobbering the offload directory)
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ..config import FaultConfig  # its kind is one of config.FAULT_KINDS, the ones listed above


class Faults:
    def __init__(self, cfg: FaultConfig, rank: int, resumed: bool, offload_files: Path | None = None,
                 world: int = 1):
        """offload_files: the directory of this run's disk-offload files (truncate-offload), if any. world: the
        ranks that take turns (slow-turns)."""
        self.cfg, self.rank, self.offload_files, self.world = cfg, rank, offload_files, world
        # A learning rate must agree everywhere; turns are taken by every rank.
        on_this_rank = cfg.kind in ("lr-spike", "slow-turns") or rank == cfg.rank
        self.armed = bool(cfg.kind) and on_this_rank and not resumed

    def _fires(self, kinds: tuple[str, ...], step: int) -> bool:
        if self.armed and self.cfg.kind in kinds and step == self.cfg.step:
            self.armed = False
            return True
        return False

    def at_step_start(self, step: int) -> None:
        if self.armed and self.cfg.kind == "slow" and step >= self.cfg.step:
            time.sleep(self.cfg.slow_s)
        if self.armed and self.cfg.kind == "slow-turns" and step >= self.cfg.step and step % self.world == self.rank:
            time.sleep(self.cfg.slow_s)
        if self._fires(("sigkill",), step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires(("sigterm",), step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._fires(("truncate-offload",), step) and self.offload_files is not None:
            for path in self.offload_files.glob(f"rank-{self.rank:05d}-*.bin"):
                os.truncate(path, path.stat().st_size // 2)

    def lr_factor(self, step: int) -> float:
        return self.cfg.lr_multiplier if self._fires(("lr-spike",), step) else 1.0

    def after_shard_written(self, step: int) -> None:
        """Called by a checkpoint save (possibly from its writer thread) once the shard is on disk."""
        if self._fires(("kill-in-save",), step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires(("save-error",), step):
            raise OSError(f"injected write failure (--fault.kind save-error at step {step})")
