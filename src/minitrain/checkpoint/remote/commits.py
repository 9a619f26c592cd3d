"""What a checkpoint is in the store, and reading it back: the prefix its objects go under (named after its
manifest's sha256), its commit object, the run's latest.json, and the listing of committed steps (read afresh:
fsspec's listing cache invalidated every time)."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ..format import MANIFEST, CheckpointError, step_dir_name
from .client import retried, store

LATEST_NAME = "latest.json"


def commit_name(step: int) -> str:
    return f"{step_dir_name(step)}.json"


def object_prefix(step_dir: Path) -> str:
    return f"{step_dir.name}/{manifest_sha256(step_dir)[:16]}"


def manifest_sha256(step_dir: Path) -> str:
    return hashlib.sha256((step_dir / MANIFEST).read_bytes()).hexdigest()


def committed_steps(url: str) -> list[int]:
    """Steps with a commit object under URL, newest first (read afresh: no cached listing)."""
    fs, root = store(url)
    fs.invalidate_cache()
    try:
        names = retried(f"listing {url}", lambda: fs.ls(root, detail=False))
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        base = name.rstrip("/").rsplit("/", 1)[-1]
        if base.startswith("step-") and base.endswith(".json") and base[5:-5].isdigit():
            steps.append(int(base[5:-5]))
    return sorted(steps, reverse=True)


def read_commit(url: str, step: int) -> dict:
    fs, root = store(url)
    path = f"{root}/{commit_name(step)}"
    try:
        commit = json.loads(retried(f"reading {url}/{commit_name(step)}", lambda: fs.cat_file(path)))
    except FileNotFoundError:
        raise CheckpointError(f"no committed checkpoint of step {step} under {url}") from None
    except ValueError as e:
        raise CheckpointError(f"{url}/{commit_name(step)} is not a commit object: {e}") from None
    if not _well_formed(commit, step):
        raise CheckpointError(f"{url}/{commit_name(step)} is not a commit object of step {step}")
    return commit


def _well_formed(commit, step: int) -> bool:
    """The fields a commit needs, of their types; its prefix inside its step (never the run's root)."""
    return (isinstance(commit, dict) and commit.get("step") == step
            and isinstance(commit.get("prefix"), str)
            and re.fullmatch(rf"{step_dir_name(step)}/[0-9a-f]{{16}}", commit["prefix"]) is not None
            and isinstance(commit.get("manifest_sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", commit["manifest_sha256"]) is not None
            and isinstance(commit.get("files"), dict) and MANIFEST in commit["files"]
            and all(isinstance(n, str) and isinstance(b, int) and not isinstance(b, bool) and b >= 0
                    for n, b in commit["files"].items()))


def latest_step(url: str) -> int | None:
    """The run's current checkpoint in the store: what URL/latest.json names if that is committed, else the newest
    committed one (a store written before the pointer, or a pointer lost); None if none is."""
    steps = committed_steps(url)
    if not steps:
        return None
    fs, root = store(url)
    try:
        named = json.loads(retried(f"reading {url}/{LATEST_NAME}", lambda: fs.cat_file(f"{root}/{LATEST_NAME}")))
        step = named["step"] if isinstance(named, dict) else None
    except (FileNotFoundError, ValueError, KeyError):
        step = None
    return step if step in steps else steps[0]


def listing(url: str) -> list[dict]:
    """The committed checkpoints under URL, newest first: step, bytes, prefix."""
    return [{"step": step, "bytes": sum(commit["files"].values()), "prefix": commit["prefix"]}
            for step in committed_steps(url) for commit in [read_commit(url, step)]]
