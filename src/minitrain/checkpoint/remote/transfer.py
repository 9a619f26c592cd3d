"""One process moving a checkpoint to and from the store: its files up under their prefix, the commit written
create-only (the store's stand-in for a rename), what no commit names swept, and a committed checkpoint fetched
and verified into a local directory (for a resume, or for a command that reads a URL)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from ..files import _write_durably, find_latest, read_manifest, verify
from ..format import LATEST, MANIFEST, MANIFEST_SHA, CheckpointError, step_dir_name, step_of
from .client import is_url, retried, store
from .commits import LATEST_NAME, commit_name, committed_steps, latest_step, manifest_sha256, object_prefix, read_commit

FETCH_LOCK = ".fetch.lock"  # in OUT/checkpoints: one fetch at a time per machine


def upload_files(step_dir: Path, url: str, names: list[str]) -> None:
    """Put these files of a complete local step directory under the prefix its manifest names (one rank's share
    of the upload; large files go up in parts, as the store's client does)."""
    fs, root = store(url)
    prefix = f"{root}/{object_prefix(step_dir)}"
    for name in names:
        retried(f"uploading {url}/{object_prefix(step_dir)}/{name}",
                lambda name=name: fs.put_file(str(step_dir / name), f"{prefix}/{name}"))


def commit_upload(step_dir: Path, url: str) -> dict:
    """After every rank's upload_files: write the commit object, create-only. The same checkpoint committed
    before is left as it is; another one of the same step (a line resumed from an older step) is replaced, its
    objects deleted. Returns the commit object."""
    fs, root = store(url)
    step = step_of(step_dir)
    manifest = read_manifest(step_dir)
    commit = {"step": step, "prefix": object_prefix(step_dir), "manifest_sha256": manifest_sha256(step_dir),
              "files": {e["name"]: e["bytes"] for e in manifest["files"]}
              | {MANIFEST: (step_dir / MANIFEST).stat().st_size, MANIFEST_SHA: (step_dir / MANIFEST_SHA).stat().st_size}}
    path, text = f"{root}/{commit_name(step)}", json.dumps(commit, indent=1).encode()
    what = f"committing {url}/{commit_name(step)}"
    try:
        retried(what, lambda: _create_only(fs, path, text))
    except FileExistsError:
        before = read_commit(url, step)
        if before["manifest_sha256"] == commit["manifest_sha256"]:
            commit = before  # a retried save: that checkpoint is already there
        else:
            # Another checkpoint of this step (a line resumed from an older one): one PUT replaces the commit, whole
            # (a failure leaves the old one committed); only then do the old objects go.
            retried(what, lambda: fs.pipe_file(path, text))
            _remove_prefix(fs, f"{root}/{before['prefix']}")
    retried(f"writing {url}/{LATEST_NAME}",
            lambda: fs.pipe_file(f"{root}/{LATEST_NAME}", json.dumps({"step": step}).encode()))
    return commit


def _create_only(fs, path: str, data: bytes) -> None:
    # Mode "xb": s3fs sends If-None-Match: * (the store refuses if the object exists: FileExistsError); the memory
    # filesystem refuses likewise; a shared filesystem's store creates it whole (local_store.py).
    if hasattr(fs, "create_only"):
        fs.create_only(path, data)
        return
    with fs.open(path, "xb") as f:
        f.write(data)


def sweep(url: str, keep_last: int = 0) -> list[int]:
    """Rank 0, after a commit: delete the objects no commit names (saves that failed or were cut off), and with
    keep_last > 0, as OUT/checkpoints' keep_last does, all but the newest keep_last checkpoints of the run's current
    line: never the one latest.json names, and those of higher steps (a line abandoned by resuming from an older
    step) too; each commit object first, so that a step is never listed without its files. Returns the steps
    deleted."""
    fs, root = store(url)
    steps, current = committed_steps(url), latest_step(url)
    doomed = []
    if keep_last and current is not None:
        line = [step for step in steps if step <= current]
        keep = set(line[:keep_last]) | {current}
        doomed = [step for step in steps if step not in keep]
    for step in doomed:
        commit = read_commit(url, step)
        retried(f"deleting {url}/{commit_name(step)}", lambda step=step: fs.rm_file(f"{root}/{commit_name(step)}"))
        _remove_prefix(fs, f"{root}/{commit['prefix']}")
    live = {read_commit(url, step)["prefix"] for step in steps if step not in doomed}
    fs.invalidate_cache()
    for step_prefix in retried(f"listing {url}", lambda: fs.glob(f"{root}/step-*/*")):
        relative = step_prefix[len(root) + 1:]
        if fs.isdir(step_prefix) and relative not in live:
            _remove_prefix(fs, step_prefix)
    return doomed


def _remove_prefix(fs, prefix: str) -> None:
    try:
        retried(f"deleting {prefix}", lambda: fs.rm(prefix, recursive=True))
    except FileNotFoundError:
        pass


def fetch(url: str, step: int, local_root: Path) -> Path:
    """Download the committed checkpoint of `step` into local_root/step-N (verified against its manifest, whose
    own sha256 must be the commit's) and return that directory. A complete local copy that verifies is kept."""
    local_root = Path(local_root)
    final = local_root / step_dir_name(step)
    commit = read_commit(url, step)
    if _verifies(final, commit):
        return final
    fs, root = store(url)
    local_root.mkdir(parents=True, exist_ok=True)
    # Into a directory of its own (other ranks of this node may fetch at the same time), then renamed into place.
    holder = local_root / f".fetch-{uuid.uuid4().hex[:12]}"
    scratch = holder / step_dir_name(step)
    scratch.mkdir(parents=True)
    try:
        for name, size in commit["files"].items():
            if "/" in name or name.startswith("."):
                raise CheckpointError(f"{url}/{commit_name(step)} names a file '{name}' outside its checkpoint")
            source = f"{root}/{commit['prefix']}/{name}"
            try:
                retried(f"downloading {url}/{commit['prefix']}/{name}",
                        lambda source=source, name=name: fs.get_file(source, str(scratch / name)))
            except FileNotFoundError:
                raise CheckpointError(f"{url}/{commit['prefix']}/{name} is missing from the store") from None
            if (scratch / name).stat().st_size != size:
                raise CheckpointError(f"{url}/{commit['prefix']}/{name} has {(scratch / name).stat().st_size} bytes, "
                                      f"its commit says {size}")
        if manifest_sha256(scratch) != commit["manifest_sha256"]:
            raise CheckpointError(f"{url}/{commit['prefix']}/{MANIFEST} is not the manifest its commit names "
                                  "(sha256 differs): refused")
        try:
            verify(scratch)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint {url}/{commit['prefix']} refused: {e}") from None
        if _verifies(final, commit):
            return final  # another process of this node fetched it meanwhile
        if final.exists():
            shutil.rmtree(final)
        os.replace(scratch, final)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return final


def _verifies(step_dir: Path, commit: dict) -> bool:
    """step_dir holds this commit's checkpoint, whole (every file checked)."""
    if not (step_dir / MANIFEST).is_file() or manifest_sha256(step_dir) != commit["manifest_sha256"]:
        return False
    try:
        verify(step_dir)
    except CheckpointError:
        return False
    return True


def split_step(location: str) -> tuple[str, int | None]:
    """URL/step-000006 -> (URL, 6); URL -> (URL, None)."""
    head, _, last = location.rstrip("/").rpartition("/")
    named = re.fullmatch(r"step-([0-9]+)", last)
    return (head, int(named.group(1))) if named else (location.rstrip("/"), None)


@contextlib.contextmanager
def local_copy(location: str):
    """A checkpoint to read, as a local path: a PATH as it is; a URL (its newest committed checkpoint, or
    URL/step-N for that one) fetched and verified into a temporary directory, removed afterwards."""
    if not is_url(location):
        yield location
        return
    url, step = split_step(location)
    if step is None:
        step = latest_step(url)
        if step is None:
            raise CheckpointError(f"no committed checkpoint under {url}")
    with tempfile.TemporaryDirectory(prefix="minitrain-fetch-") as scratch:
        yield str(fetch(url, step, Path(scratch)))


def newest_locally(url: str, local_root: Path) -> Path | None:
    """For --resume auto with a store: when the store's current checkpoint (latest.json) is ahead of the one
    OUT/checkpoints would resume from (its `latest`, verified), or OUT has none (the node and its disk were lost),
    fetch it into local_root, point local `latest` at it and return it; else None (resume from the local one: a
    store behind it, e.g. after a failed upload, is not used). The ranks of a machine (under torchrun, each resolves
    its resume) fetch one at a time: the first fetches, the others then find it here."""
    step = latest_step(url)
    if step is None or _local_is_as_new(local_root, step):
        return None
    local_root = Path(local_root)
    local_root.mkdir(parents=True, exist_ok=True)
    with open(local_root / FETCH_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _local_is_as_new(local_root, step):  # fetched by another process of this machine meanwhile
            return None
        fetched = fetch(url, step, local_root)
        _write_durably(local_root / LATEST, fetched.name + "\n")  # what --resume auto looks at first
        return fetched


def _local_is_as_new(local_root: Path, step: int) -> bool:
    try:
        chosen = find_latest(Path(local_root).parent)
    except CheckpointError:
        return False  # saved here, but nothing verifies: the store's is the one to resume from
    return chosen is not None and step_of(chosen) >= step
