"""Where a sharded corpus lives: a local directory, or a store URL (s3://bucket/prefix, any fsspec URL).

A store may be down for a while: every read is retried with backoff, capped, until a deadline (the run waits
and then goes on, saying once that it is waiting). What retrying cannot mend (an object that is not there) is
an answer, raised at once as DataError naming the object. hdfs:// is refused with the reason where pyarrow's
HDFS client (which needs libhdfs) is not present.
"""
from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

from ..errors import ConfigError
from ..utils.object_store import CLIENT_ERRORS, FINAL, is_url, remote_store

FIRST_BACKOFF_S = 0.5  # the wait after the first failed try, doubled after each further one ...
MAX_BACKOFF_S = 10.0  # ... up to this, so a store that comes back is noticed within it
STORE_TIMEOUT_S = 240.0  # how long a read keeps retrying an unreachable store before the run stops


class DataError(ConfigError):
    """The training data cannot be used as it is (a shard missing or altered, the cache unusable): one line
    naming what to fix. A ConfigError, so the rank exits 2 and no checkpoint is written after it."""


class CorpusStore:
    """The objects of one corpus: `read(name)` gives an object's bytes, `fetch(name, path)` copies it to a local
    file. Local directories are read in place; `local_path(name)` says where (None for a store)."""

    def __init__(self, location: str, timeout_s: float = STORE_TIMEOUT_S):
        self.location, self.timeout_s = location.rstrip("/") or location, timeout_s
        self.remote = is_url(location)
        if location.startswith("hdfs://"):
            _check_hdfs(location)
        self.fs, self.root = (remote_store(location, "corpus", DataError) if self.remote
                              else (None, location.removeprefix("file://")))

    def local_path(self, name: str) -> Path | None:
        return None if self.remote else Path(self.root) / name

    def describe(self, name: str) -> str:
        return f"{self.location}/{name}"

    def read(self, name: str) -> bytes:
        if not self.remote:
            try:
                return (Path(self.root) / name).read_bytes()
            except FileNotFoundError:
                raise DataError(_missing(self.describe(name))) from None
            except OSError as e:
                raise DataError(f"cannot read {self.describe(name)}: {_reason(e)}") from None
        return self._patiently(name, lambda: self.fs.cat_file(f"{self.root}/{name}"))

    def fetch(self, name: str, path: Path) -> None:
        """The object `name` into the local file `path` (which the caller then verifies)."""
        self._patiently(name, lambda: self.fs.get_file(f"{self.root}/{name}", str(path)))

    def sizes(self) -> dict[str, int]:
        """Every object's size in bytes, by name (one listing for a store)."""
        if not self.remote:
            try:
                return {e.name: e.stat().st_size for e in os.scandir(self.root) if e.is_file()}
            except OSError as e:
                raise DataError(f"cannot list {self.location}: {_reason(e)}") from None
        listing = self._patiently("", lambda: self.fs.ls(self.root, detail=True, refresh=True))
        return {entry["name"].rsplit("/", 1)[-1]: int(entry.get("size") or 0) for entry in listing}

    def _patiently(self, name: str, fn):
        """fn() until the store answers: transient failures retried with capped backoff until timeout_s."""
        timeout_s = self.timeout_s
        deadline, wait, said = time.monotonic() + timeout_s, FIRST_BACKOFF_S, False
        while True:
            try:
                return fn()
            except FileNotFoundError:
                raise DataError(_missing(self.describe(name))) from None
            except Exception as e:  # noqa: BLE001 - a store's client raises many kinds for "try again"
                if not _transient(e):
                    raise DataError(f"cannot read {self.describe(name)}: {_reason(e)}") from None
                if time.monotonic() + wait > deadline:
                    raise DataError(f"cannot read {self.describe(name)}: no answer for {timeout_s:.0f} s "
                                    f"({_reason(e)}); check the store, then resume") from None
                if not said:  # once per outage: the run is waiting, not hung
                    print(f"waiting for {self.describe(name)}: {_reason(e)} (retrying for up to {timeout_s:.0f} s)",
                          file=sys.stderr, flush=True)
                    said = True
            time.sleep(wait)
            wait = min(wait * 2, MAX_BACKOFF_S)


def _missing(what: str) -> str:
    return f"{what} is missing: the corpus's index.json lists it; restore it or prepare the corpus again"


# What a store's client raises for a request retrying cannot mend (botocore's names): no credentials, no region, a
# malformed request.
REFUSALS = ("NoCredentialsError", "PartialCredentialsError", "NoRegionError", "ParamValidationError",
            "InvalidBucketName")


def _transient(error: BaseException) -> bool:
    """Worth retrying: not an answer (FINAL: missing, forbidden) and not a refusal (a full disk, a bad request,
    no credentials)."""
    if isinstance(error, FINAL) or type(error).__name__ in REFUSALS:
        return False
    return not isinstance(error, OSError) or error.errno not in CLIENT_ERRORS


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _check_hdfs(location: str) -> None:
    try:
        from pyarrow import fs as pafs

        pafs.HadoopFileSystem.from_uri(location)
    except Exception as e:  # noqa: BLE001 - no pyarrow, no libhdfs, no namenode: each a reason to refuse
        raise DataError(f"cannot read {location}: HDFS needs pyarrow with libhdfs (a Hadoop client installed, "
                        f"HADOOP_HOME and CLASSPATH set) and here {_reason(e)}; copy the corpus to a directory or "
                        "an S3 bucket instead") from None


def read_text(store: CorpusStore, name: str) -> str:
    """An object of the corpus as UTF-8 text (index.json); DataError naming it otherwise."""
    data = store.read(name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{store.describe(name)} is not UTF-8 text; prepare the corpus again") from None


def disk_full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT)

