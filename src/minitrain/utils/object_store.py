"""Reaching an object store through fsspec (s3://, memory://, any fsspec URL), every request retried.

Checkpoints (checkpoint/remote/) and training data (corpus/store.py) both live in stores; this module holds
what they share: which strings name a store, the filesystem that serves one, and the retry loop. Transient
failures (a dropped connection, a throttled request) are retried with bounded exponential backoff; after the last
try the error, of the caller's class, names what was being done. Credentials, region and endpoint come from the
usual AWS variables and files (AWS_ENDPOINT_URL for an S3-compatible server); s3:// needs the s3fs package.
"""
from __future__ import annotations

import errno
import functools
import time

TRIES = 5  # attempts of one operation on the store before it fails
FIRST_BACKOFF_S = 0.5  # the wait after the first failed try, doubled after each further one
# Raised by the store for what retrying cannot mend (these are answers, not failures to answer).
FINAL = (FileExistsError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
# OSError numbers that s3fs gives a 4xx answer other than throttling, and the local disk's own refusals.
CLIENT_ERRORS = (errno.EINVAL, errno.ENOSPC, errno.EROFS, errno.EDQUOT)


class StoreError(Exception):
    """A store that cannot be used, or an operation on it that failed every try."""


def is_local(location: str) -> bool:
    """A path, or a file:// URL: a location on a filesystem this machine mounts."""
    return "://" not in location or location.startswith("file://")


def is_url(path: str) -> bool:
    """A location fsspec reaches through a protocol other than the local filesystem's."""
    return "://" in str(path) and not str(path).startswith("file://")


def remote_store(url: str, what: str = "location", error: type[Exception] = StoreError):
    """(fsspec filesystem, root path inside it) for a store URL; a missing package or an unknown scheme raises
    `error` naming `what` (e.g. "checkpoint location")."""
    import fsspec  # only runs that read or write a URL import it

    try:
        if url.startswith(("s3://", "s3a://")):
            fs = s3_filesystem_class()(config_kwargs=s3_client_settings())
            return fs, fs._strip_protocol(url).rstrip("/")
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        hint = " (pip install 'minitrain[s3]')" if url.startswith("s3") else ""
        raise error(f"cannot use {what} {url}: {str(e).splitlines()[0]}{hint}") from None
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


def retried(what: str, fn, tries: int = TRIES, error: type[Exception] = StoreError,
            backoff_s: float = FIRST_BACKOFF_S):
    """fn() with bounded exponential backoff on transient errors; `error` naming `what` at the end. Answers
    (FINAL: a missing object, a refused permission) pass through at once."""
    for attempt in range(tries):
        try:
            return fn()
        except FINAL:
            raise
        except OSError as e:
            if e.errno in CLIENT_ERRORS:  # a request the store refuses as such, or the local disk full: final
                raise error(f"{what} failed: {type(e).__name__}: {e}") from e
            if attempt == tries - 1:
                raise error(f"{what} failed {tries} times; the last error: {type(e).__name__}: {e}") from e
        except Exception as e:
            if attempt == tries - 1:
                raise error(f"{what} failed {tries} times; the last error: {type(e).__name__}: {e}") from e
        time.sleep(backoff_s * 2 ** attempt)
