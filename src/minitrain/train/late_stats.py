"""Late statistics (--train.late_stats): the trainer issues a step's statistics exchange and reads it while the
next step runs, so the host never waits for the device between steps (trainer.py's launch_step and settle).
What a step launched and not yet read carries, and when the trainer may read late."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError, RunConfig
from ..runtime.comm import OpStats
from .step_timer import StepTimer


@dataclass
class LaunchedStep:
    """A step whose work and statistics exchange are issued and whose statistics are not read yet (Trainer._read):
    what its record needs from the moment it was launched."""

    step: int
    lr: float
    loss_scale: float
    tokens_seen: int
    start: float  # host clock when the step began
    start_mark: torch.cuda.Event | None  # on a GPU: where the device began it
    ended: float  # host clock when its launch returned (on the CPU, when it was done)
    timer: StepTimer  # its phases' marks
    sync_marks: tuple | None  # its gradient sync's marks (FlatStrategy.sync_at)
    bracketed: dict  # --measure-sync's figures
    rows: torch.Tensor  # every rank's packed RankStats, on the host (once `copied` has fired)
    copied: torch.cuda.Event | None  # on a GPU: fires when `rows` is complete (and ends the step's time)
    comm: tuple[OpStats | None, OpStats | None]  # collective totals before and after it (None: taken at the read)


def reads_late(cfg: RunConfig, device: torch.device, strategy, loss_scaler, pipeline) -> bool:
    """Whether the trainer reads each step's statistics while the next step runs (--train.late_stats). It needs the
    update to skip a non-finite step on the device (the fused kernel's found_inf; FlatAdamW's step count is taken
    back there too), and neither fp16's loss scale nor a pipeline's schedule waiting on the last step's figures.
    auto: on a GPU, where the host would otherwise wait for every step's last kernel before launching the next."""
    mode = cfg.train.late_stats
    possible = strategy.steps_on_device and loss_scaler is None and pipeline is None
    if mode == "on" and not possible:
        raise ConfigError("--train.late_stats on needs the fused optimizer's on-device skip (CPU or CUDA), "
                          "no fp16 loss scale and no pipeline; use auto or off")
    return mode == "on" or (mode == "auto" and possible and device.type == "cuda")
