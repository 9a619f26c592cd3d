"""The checkpoint format's names and its error: what files.py, schema.py and the rest share (so that none of
them imports another for a name). What the format holds: checkpoint/__init__.py."""
from __future__ import annotations

from pathlib import Path

FORMAT = "minitrain-checkpoint/5"
MANIFEST = "manifest.json"
MANIFEST_SHA = "manifest.sha256"  # written after the manifest, before the directory is renamed into place
LATEST = "latest"


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, corrupt or does not fit this run."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(step_dir: Path) -> int:
    """The step a step directory's name says (step-000010 -> 10; step-1000000 -> 1000000; a copy moved
    aside during a re-save, .old-step-000010 -> 10)."""
    return int(step_dir.name.rpartition("step-")[2])


def shard_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


WRITTEN_BY = "minitrain.written_by"  # the one metadata key of a shard's safetensors header


def written_by(rank: int, step: int) -> str:
    """The shard header's record of who wrote it: "rank 1, step 10"."""
    return f"rank {rank}, step {step}"
