"""Checkpoints on object storage: `--ckpt.dir URL` (s3://bucket/prefix, memory://, any fsspec URL), or on a filesystem
every machine mounts (`--ckpt.dir /path`: local_store.py).

A run still writes each checkpoint into OUT/checkpoints first (the local, crash-safe save of files.py and
writing.py); once that is complete, the ranks upload it and the checkpoint exists in the store when its commit
object does:

  URL/step-000006/<sha>/manifest.json      the step directory's files, under a prefix named after the manifest's
  URL/step-000006/<sha>/rank-00000....      sha256: a retried save of the same checkpoint writes the same objects,
  URL/step-000006.json                      a different one (after a rollback) other ones, never over committed ones
                                            the commit: {"step", "prefix", "manifest_sha256", "files": {name: bytes}},
                                            written last, create-only (If-None-Match: *), after every rank's uploads
  URL/latest.json                           {"step": 6}: the run's current checkpoint, rewritten after each commit (a
                                            run resumed from an older step makes a new line: the store's `latest`,
                                            like OUT/checkpoints/latest, says which line is the run's)

Object stores have no atomic rename, so the commit object plays the part the directory rename plays on a disk: a
step without one does not exist for resume, listing or keep_last, and its objects are swept by a later save. A
reader downloads a committed checkpoint into OUT/checkpoints (a directory of a unique name, renamed into place
once every file arrived and the whole checkpoint verified against its manifest, whose own sha256 must be the
commit's): a tampered or truncated object is refused naming it. Listings are read afresh (fsspec's listing cache
invalidated) every time.

Where each machine has a disk of its own (OUT not shared), a machine's OUT/checkpoints holds its own ranks' files
and the manifest: each rank uploads its file, rank 0 the manifest, and once committed a machine's partial copy is
removed; the checkpoint exists whole in the store only, and a resume fetches it onto every machine.

Transient failures (a dropped connection, a throttled request) are retried with bounded exponential backoff;
after the last try the error names the object. A failed upload leaves the previous committed checkpoint as it was.

Credentials, region and endpoint come from the usual AWS variables and files (AWS_ENDPOINT_URL for an S3-compatible
server); s3:// needs the s3fs package.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from .files import _write_durably, find_latest, read_manifest, verify
from .format import LATEST, MANIFEST, MANIFEST_SHA, CheckpointError, shard_file_name, step_dir_name, step_of

TRIES = 5  # attempts of one operation on the store before it fails the save or the load
FIRST_BACKOFF_S = 0.5  # then 1, 2, 4: 7.5 s of waiting in all
# Raised by the store for what retrying cannot mend (these are answers, not failures to answer).
_FINAL = (FileExistsError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
# OSError numbers that s3fs gives a 4xx answer other than throttling, and the local disk's own refusals.
_CLIENT_ERRORS = (errno.EINVAL, errno.ENOSPC, errno.EROFS, errno.EDQUOT)
LATEST_NAME = "latest.json"


def is_local(location: str) -> bool:
    """A path, or a file:// URL: a location on a filesystem this machine mounts."""
    return "://" not in location or location.startswith("file://")


def is_url(path: str) -> bool:
    """A location fsspec reaches through a protocol other than the local filesystem's."""
    return "://" in str(path) and not str(path).startswith("file://")


def store(url: str):
    """(fsspec filesystem, root path inside it) for URL; a missing package or unknown scheme as CheckpointError."""
    import fsspec  # only runs that write or read a URL import it

    if is_local(url):  # a shared filesystem: written as safely as OUT (local_store.py)
        from .local_store import DurableLocalFileSystem

        fs = DurableLocalFileSystem()
        return fs, fs._strip_protocol(url).rstrip("/")
    try:
        if url.startswith(("s3://", "s3a://")):
            fs = s3_filesystem_class()(config_kwargs=s3_client_settings())
            return fs, fs._strip_protocol(url).rstrip("/")
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        hint = " (pip install 'minitrain[s3]')" if url.startswith("s3") else ""
        raise CheckpointError(f"cannot use checkpoint location {url}: {str(e).splitlines()[0]}{hint}") from None
    return fs, root.rstrip("/")


def s3_client_settings() -> dict:
    """One bounded retry loop, ours (retried): the S3 client's own retries, several deep, would multiply it to
    minutes before a dead store is reported. A new dict each time: s3fs changes the one it is given, and fsspec
    finds its cached filesystem by these arguments."""
    return {"retries": {"total_max_attempts": 1}, "connect_timeout": 10, "read_timeout": 60}


@functools.cache
def s3_filesystem_class():
    """s3fs's filesystem without its own retry loop around each request (a class setting, 5 by default): a class
    of ours, so that other users of s3fs in the process keep theirs (and fsspec caches its instances apart)."""
    import s3fs

    return type("OneTryS3FileSystem", (s3fs.S3FileSystem,), {"retries": 1})


def check_location(url: str) -> None:
    """Before a run: the store's package is installed and the location answers (ConfigError, one line)."""
    from ..errors import ConfigError

    if is_local(url):  # a directory every machine mounts: made now, and it must take files
        root = Path(url.removeprefix("file://"))
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--ckpt.dir {url}: cannot use it: {e.strerror}") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError(f"--ckpt.dir {url}: cannot use it: this process may not write there")
        return
    try:
        fs, root = store(url)
        retried(f"reaching {url}", lambda: fs.ls(root.split("/", 1)[0], detail=False), tries=2)
    except Exception as e:  # noqa: BLE001 - whatever the store's client says is the reason
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"--ckpt.dir {url}: cannot use it: {reason}") from None


def retried(what: str, fn, tries: int = TRIES):
    """fn() with bounded exponential backoff on transient errors; CheckpointError naming `what` at the end."""
    for attempt in range(tries):
        try:
            return fn()
        except _FINAL:
            raise
        except OSError as e:
            if e.errno in _CLIENT_ERRORS:  # a request the store refuses as such, or the local disk full: final
                raise CheckpointError(f"{what} failed: {type(e).__name__}: {e}") from e
            if attempt == tries - 1:
                raise CheckpointError(f"{what} failed {tries} times; the last error: {type(e).__name__}: {e}") \
                    from e
            time.sleep(FIRST_BACKOFF_S * 2 ** attempt)
        except Exception as e:  # noqa: BLE001 - the store's client raises many kinds for "try again"
            if attempt == tries - 1:
                raise CheckpointError(f"{what} failed {tries} times; the last error: {type(e).__name__}: {e}") \
                    from e
            time.sleep(FIRST_BACKOFF_S * 2 ** attempt)


def _commit_name(step: int) -> str:
    return f"{step_dir_name(step)}.json"


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
    path = f"{root}/{_commit_name(step)}"
    try:
        commit = json.loads(retried(f"reading {url}/{_commit_name(step)}", lambda: fs.cat_file(path)))
    except FileNotFoundError:
        raise CheckpointError(f"no committed checkpoint of step {step} under {url}") from None
    except ValueError as e:
        raise CheckpointError(f"{url}/{_commit_name(step)} is not a commit object: {e}") from None
    if not _well_formed(commit, step):
        raise CheckpointError(f"{url}/{_commit_name(step)} is not a commit object of step {step}")
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


def upload_files(step_dir: Path, url: str, names: list[str]) -> None:
    """Put these files of a complete local step directory under the prefix its manifest names (one rank's share
    of the upload; large files go up in parts, as the store's client does)."""
    fs, root = store(url)
    prefix = f"{root}/{_prefix(step_dir)}"
    for name in names:
        retried(f"uploading {url}/{_prefix(step_dir)}/{name}",
                lambda name=name: fs.put_file(str(step_dir / name), f"{prefix}/{name}"))


def commit_upload(step_dir: Path, url: str) -> dict:
    """After every rank's upload_files: write the commit object, create-only. The same checkpoint committed
    before is left as it is; another one of the same step (a line resumed from an older step) is replaced, its
    objects deleted. Returns the commit object."""
    fs, root = store(url)
    step = step_of(step_dir)
    manifest = read_manifest(step_dir)
    commit = {"step": step, "prefix": _prefix(step_dir), "manifest_sha256": _manifest_sha(step_dir),
              "files": {e["name"]: e["bytes"] for e in manifest["files"]}
              | {MANIFEST: (step_dir / MANIFEST).stat().st_size, MANIFEST_SHA: (step_dir / MANIFEST_SHA).stat().st_size}}
    path, text = f"{root}/{_commit_name(step)}", json.dumps(commit, indent=1).encode()
    what = f"committing {url}/{_commit_name(step)}"
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
        retried(f"deleting {url}/{_commit_name(step)}", lambda step=step: fs.rm_file(f"{root}/{_commit_name(step)}"))
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
                raise CheckpointError(f"{url}/{_commit_name(step)} names a file '{name}' outside its checkpoint")
            source = f"{root}/{commit['prefix']}/{name}"
            try:
                retried(f"downloading {url}/{commit['prefix']}/{name}",
                        lambda source=source, name=name: fs.get_file(source, str(scratch / name)))
            except FileNotFoundError:
                raise CheckpointError(f"{url}/{commit['prefix']}/{name} is missing from the store") from None
            if (scratch / name).stat().st_size != size:
                raise CheckpointError(f"{url}/{commit['prefix']}/{name} has {(scratch / name).stat().st_size} bytes, "
                                      f"its commit says {size}")
        if _manifest_sha(scratch) != commit["manifest_sha256"]:
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


class Upload:
    """One checkpoint of OUT/checkpoints going up to the store: this rank's share of its files (one directory for
    all: the files dealt out; each machine its own disk: each rank's own file, and rank 0's the manifest, which
    writing.commit gave every machine), in a background thread when asked; then commit() (collective) writes the
    commit object once every rank's share is up."""

    def __init__(self, step_dir: Path, url: str, topo, keep_last: int = 0, background: bool = False):
        """Collective (every rank says whether its copy is whole)."""
        self.step_dir, self.url, self.topo, self.keep_last = Path(step_dir), url, topo, keep_last
        self.whole = topo.everyone.gather_json(_whole(self.step_dir))
        names = sorted(p.name for p in self.step_dir.iterdir())
        self.mine = (names[topo.rank::topo.world_size] if all(self.whole) else
                     [shard_file_name(topo.rank)] + ([MANIFEST, MANIFEST_SHA] if topo.is_main else []))
        self.error: str | None = None
        self._done = threading.Event()
        if background:
            threading.Thread(target=self._upload, name=f"upload-{self.step_dir.name}", daemon=True).start()
        else:
            self._upload()

    def _upload(self) -> None:
        self.error = _failure(lambda: upload_files(self.step_dir, self.url, self.mine))
        self._done.set()

    @property
    def written(self) -> bool:
        """This rank's share is up (or failed): commit would not wait for it."""
        return self._done.is_set()

    def commit(self) -> Path:
        """Collective: once every rank's share is up, rank 0 commits the checkpoint in the store and sweeps what no
        commit names (and all but keep_last); a machine's partial copy then goes. A failure anywhere raises
        CheckpointError on every rank, naming the object; what was committed before stays. Returns the step
        directory (gone where it held a machine's share only)."""
        self._done.wait()
        everyone, name = self.topo.everyone, self.step_dir.name
        _raise_if_any(everyone.gather_json(self.error), f"uploading {name} to {self.url}")
        error = _failure(lambda: commit_upload(self.step_dir, self.url)) if self.topo.is_main else None
        _raise_if_any(everyone.gather_json(error), f"committing {name} in {self.url}")
        if not self.whole[self.topo.rank]:  # a machine's share of a checkpoint resumes nothing: the store has it
            _forget(self.step_dir)
        if self.topo.is_main:  # the checkpoint is committed; leftovers that stay are swept by a later save
            swept = _failure(lambda: sweep(self.url, self.keep_last))
            if swept:
                print(f"minitrain: warning: sweeping {self.url} after committing {name}: {swept}", file=sys.stderr,
                      flush=True)
        return self.step_dir


def upload_collectively(step_dir: Path, url: str, topo, keep_last: int = 0) -> Path:
    """Collective: Upload, at once (see there)."""
    return Upload(step_dir, url, topo, keep_last).commit()


def _forget(step_dir: Path) -> None:
    """Remove a machine's share of a checkpoint, and `latest` where it names it."""
    latest = step_dir.parent / LATEST
    with contextlib.suppress(OSError):
        if latest.read_text().strip() == step_dir.name:
            latest.unlink()
    shutil.rmtree(step_dir, ignore_errors=True)


def fetch_each(url: str, step: int, local_root: Path, topo) -> Path:
    """Collective: the committed checkpoint of `step` on every rank's disk (fetch: kept where a whole copy verifies,
    downloaded elsewhere, e.g. on machines whose OUT is their own); CheckpointError on every rank if a rank cannot."""
    error = _failure(lambda: fetch(url, step, local_root))
    _raise_if_any(topo.everyone.gather_json(error), f"fetching {step_dir_name(step)} from {url}")
    return Path(local_root) / step_dir_name(step)


def fetch_collectively(url: str, step: int | None, local_root: Path, topo) -> Path:
    """Collective: rank 0 fetches the checkpoint of `step` (None: the newest committed) into local_root, which every
    rank reads (on several nodes, a filesystem they share, as for every checkpoint); CheckpointError on every rank
    if it cannot."""
    fetched = None
    if topo.is_main:
        try:
            if step is None:
                step = latest_step(url)
                if step is None:
                    raise CheckpointError(f"no committed checkpoint under {url}")
            fetched = str(fetch(url, step, local_root))
        except Exception as e:  # noqa: BLE001 - the other ranks wait for word of it in the gather below
            fetched = {"error": str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"}
    [fetched, *_] = topo.everyone.gather_json(fetched)
    if isinstance(fetched, dict):
        raise CheckpointError(fetched["error"])
    return Path(fetched)


def _failure(action) -> str | None:
    """None if action() went through, else what went wrong (every rank must hear of it: the caller gathers it, so
    nothing may escape past that collective)."""
    try:
        action()
    except Exception as e:  # noqa: BLE001 - whatever it was, the other ranks wait for word of it
        return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    return None


def _raise_if_any(errors: list[str | None], what: str) -> None:
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, first = failed[0]
        raise CheckpointError(f"{what}: rank {rank}: {first}")


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


def listing(url: str) -> list[dict]:
    """The committed checkpoints under URL, newest first: step, bytes, prefix."""
    return [{"step": step, "bytes": sum(commit["files"].values()), "prefix": commit["prefix"]}
            for step in committed_steps(url) for commit in [read_commit(url, step)]]


def newest_locally(url: str, local_root: Path) -> Path | None:
    """For --resume auto with a store: when the store's current checkpoint (latest.json) is ahead of the one
    OUT/checkpoints would resume from (its `latest`, verified), or OUT has none (the node and its disk were lost),
    fetch it into local_root, point local `latest` at it and return it; else None (resume from the local one: a
    store behind it, e.g. after a failed upload, is not used)."""
    step = latest_step(url)
    if step is None:
        return None
    local_root = Path(local_root)
    try:
        chosen = find_latest(local_root.parent)
    except CheckpointError:
        chosen = None  # saved here, but nothing verifies: the store's is the one to resume from
    if chosen is not None and step_of(chosen) >= step:
        return None
    fetched = fetch(url, step, local_root)
    _write_durably(local_root / LATEST, fetched.name + "\n")  # what --resume auto looks at first
    return fetched


def _whole(step_dir: Path) -> bool:
    """step_dir holds every file its manifest names (not only this machine's ranks')."""
    return all((step_dir / entry["name"]).is_file() for entry in read_manifest(step_dir)["files"])


def _verifies(step_dir: Path, commit: dict) -> bool:
    """step_dir holds this commit's checkpoint, whole (every file checked)."""
    if not (step_dir / MANIFEST).is_file() or _manifest_sha(step_dir) != commit["manifest_sha256"]:
        return False
    try:
        verify(step_dir)
    except CheckpointError:
        return False
    return True


def _manifest_sha(step_dir: Path) -> str:
    import hashlib

    return hashlib.sha256((step_dir / MANIFEST).read_bytes()).hexdigest()


def _prefix(step_dir: Path) -> str:
    return f"{step_dir.name}/{_manifest_sha(step_dir)[:16]}"
