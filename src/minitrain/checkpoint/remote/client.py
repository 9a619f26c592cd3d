"""Reaching a checkpoint store: which kind of location a string names, the filesystem that serves it (fsspec;
a shared filesystem through local_store.py), whether it answers before a run, and every request retried.

Transient failures (a dropped connection, a throttled request) are retried with bounded exponential backoff;
after the last try the error names the object. Credentials, region and endpoint come from the usual AWS
variables and files (AWS_ENDPOINT_URL for an S3-compatible server); s3:// needs the s3fs package.
"""
from __future__ import annotations

import errno
import functools
import os
import time
from pathlib import Path

from ..format import CheckpointError

TRIES = 5  # attempts of one operation on the store before it fails the save or the load
FIRST_BACKOFF_S = 0.5  # the wait after the first failed try, doubled after each further one
# Raised by the store for what retrying cannot mend (these are answers, not failures to answer).
_FINAL = (FileExistsError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
# OSError numbers that s3fs gives a 4xx answer other than throttling, and the local disk's own refusals.
_CLIENT_ERRORS = (errno.EINVAL, errno.ENOSPC, errno.EROFS, errno.EDQUOT)


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
        from ..local_store import DurableLocalFileSystem

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
