"""Reaching a checkpoint store: which kind of location a string names, the filesystem that serves it (fsspec;
a shared filesystem through local_store.py), whether it answers before a run, and every request retried.

Transient failures (a dropped connection, a throttled request) are retried with bounded exponential backoff;
after the last try the error names the object. Credentials, region and endpoint come from the usual AWS
variables and files (AWS_ENDPOINT_URL for an S3-compatible server); s3:// needs the s3fs package.
"""
from __future__ import annotations

import os
from pathlib import Path

from ...utils import object_store
from ...utils.object_store import (  # noqa: F401 - re-exported
    is_local,
    is_url,
    s3_client_settings,
    s3_filesystem_class,
)
from ..format import CheckpointError

TRIES = object_store.TRIES  # attempts of one operation on the store before it fails the save or the load
FIRST_BACKOFF_S = object_store.FIRST_BACKOFF_S  # the wait after the first failed try, doubled after each further one


def store(url: str):
    """(fsspec filesystem, root path inside it) for URL; a missing package or unknown scheme as CheckpointError."""
    if is_local(url):  # a shared filesystem: written as safely as OUT (local_store.py)
        from ..local_store import DurableLocalFileSystem

        fs = DurableLocalFileSystem()
        return fs, fs._strip_protocol(url).rstrip("/")
    return object_store.remote_store(url, "checkpoint location", CheckpointError)


def check_location(url: str) -> None:
    """Before a run: the store's package is installed and the location answers (ConfigError, one line)."""
    from ...errors import ConfigError

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
    return object_store.retried(what, fn, tries, CheckpointError, FIRST_BACKOFF_S)
