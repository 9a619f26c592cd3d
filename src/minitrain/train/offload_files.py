"""The CLI's offload settings: where --train.offload disk keeps its files (--train.offload_dir, default
OUT/offload), checked before the run, and the run's OffloadStore (parallel/core/offload.py)."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from ..config import RunConfig
from ..errors import ConfigError
from ..models.size import model_params
from ..parallel.core.offload import OffloadStore
from .metrics import human_bytes


def offload_directory(cfg: RunConfig) -> Path:
    """OUT/offload, or a directory of this run's own under --train.offload_dir (named after OUT): two runs given
    the same offload directory never write each other's files (OUT is one run's: the launcher locks it)."""
    if not cfg.train.offload_dir:
        return Path(cfg.out) / "offload"
    run = hashlib.sha256(str(Path(cfg.out).resolve()).encode()).hexdigest()[:12]
    return Path(cfg.train.offload_dir) / f"minitrain-{Path(cfg.out).resolve().name}-{run}"


def offload_store(cfg: RunConfig, rank: int) -> OffloadStore | None:
    """The run's store, or None without offload."""
    return None if cfg.train.offload == "none" else OffloadStore(cfg.train.offload, offload_directory(cfg), rank)


def remove_offload_files(cfg: RunConfig) -> None:
    """After the launcher's ranks are gone, however they ended: their disk-offload files (a rank killed while
    another failed had no chance to remove its own), and the default directory if that leaves it empty."""
    if cfg.train.offload != "disk":
        return
    directory = offload_directory(cfg)
    for path in directory.glob("rank-[0-9]*-*.bin"):
        path.unlink(missing_ok=True)
    if directory.is_dir() and not any(directory.iterdir()):  # the run's own directory
        directory.rmdir()


def check_offload_directory(cfg: RunConfig) -> None:
    """Disk offload: its directory must be one this process can create and write (ConfigError before the run)."""
    if cfg.train.offload != "disk":
        return
    directory = offload_directory(cfg)
    existing = next(p for p in [directory, *directory.parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "it" if existing == directory else f"{existing}, where it would be made,"
        raise ConfigError(f"--train.offload disk: cannot write {directory} ({what} is not a writable directory); "
                          "choose --train.offload_dir")
    needed, free = offload_bytes(cfg), shutil.disk_usage(existing).free
    if needed > free:
        raise ConfigError(f"--train.offload disk: the optimizer state needs {human_bytes(needed)} in {directory} "
                          f"and {human_bytes(free)} are free there; free space or choose --train.offload_dir")


def offload_bytes(cfg: RunConfig) -> int:
    """What the ranks of this machine write under the offload directory: master, m and v of each rank's part of
    the parameters, in the master dtype (an upper bound: every rank counted as local, the data-parallel share
    taken over the whole world)."""
    t, d = cfg.train, cfg.dist
    element = 8 if t.dtype == "float64" else 4
    params = model_params(cfg.model) / (d.tp * d.pp)
    share = params / max(1, d.nproc // (d.tp * d.pp)) if t.zero >= 1 else params
    return int(3 * element * share * d.nproc)
