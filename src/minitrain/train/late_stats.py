"""Late statistics (--train.late_stats): the trainer issues a step's statistics exchange and reads it while the
next step runs, so the host never waits for the device between steps (trainer.py's launch_step and settle; what a
step launched and not yet read carries is step_statistics.LaunchedStep). When the trainer may read late."""
from __future__ import annotations

import torch

from ..config import ConfigError, RunConfig


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
