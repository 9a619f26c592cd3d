"""The ckpt section: when a run saves, what it keeps, where checkpoints also go, and whether it resumes."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError
from .fields import opt


@dataclass
class CheckpointConfig:
    every_steps: int = opt(0, "save a sharded checkpoint every this many steps; 0 = never")
    every_minutes: float = opt(0.0, "also save when this many minutes have passed since the last save (rank 0's "
                               "clock decides for all ranks); 0 = off")
    keep_last: int = opt(0, "keep only the newest K complete checkpoints (older ones are deleted after a save); "
                         "0 = keep all")
    resume: str = opt("", "'' = start fresh, 'auto' = newest checkpoint under OUT (or --ckpt.dir) if any, or a "
                      "checkpoint path")
    dir: str = opt("", "where the checkpoints also go: object storage (s3://bucket/prefix, or any fsspec "
                   "location) or an absolute path of a filesystem every machine mounts; each checkpoint is uploaded "
                   "there once saved in OUT/checkpoints, committed when every "
                   "rank's files are there; --resume auto fetches a newer one from it (a node's disk lost). s3:// "
                   "needs s3fs and reads the AWS_* variables (AWS_ENDPOINT_URL for an S3-compatible server); "
                   "'' = OUT/checkpoints only")
    async_save: bool = opt(False, "write checkpoint files in a background thread from a CPU snapshot while training "
                           "goes on; `latest` moves only once every rank's file is durable")
    final_save: bool = opt(True, "save a checkpoint after the last step, so every run leaves a model to export "
                           "(--no-final-save turns it off)")


def check_checkpoint(c: CheckpointConfig, out: str) -> None:
    for name in ("every_steps", "every_minutes", "keep_last"):
        if getattr(c, name) < 0:
            raise ConfigError(f"ckpt.{name} must be >= 0, got {getattr(c, name)}")
    _check_store(c.dir, out)


def _check_store(location: str, out: str) -> None:
    """--ckpt.dir: a URL, or an absolute path of a filesystem every machine mounts, apart from OUT."""
    if not location or ("://" in location and not location.startswith("file://")):
        return
    path = location.removeprefix("file://")
    if not os.path.isabs(path):
        raise ConfigError(f"--ckpt.dir {location}: give an absolute path (a filesystem every machine mounts) or a URL "
                          "of object storage (s3://bucket/prefix)")
    store, run = os.path.realpath(path), os.path.realpath(out)
    if os.path.commonpath([store, run]) in (store, run):
        raise ConfigError(f"--ckpt.dir {location} and --out {out} overlap; the store keeps checkpoints apart from "
                          "the run's OUT/checkpoints: give a directory outside OUT")
