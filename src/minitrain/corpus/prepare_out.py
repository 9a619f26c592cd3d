"""Where `minitrain data prepare` writes: a local directory, or a store prefix (s3://bucket/prefix, any fsspec URL).

Both take whole files: a shard is written in full to a temporary file first (inside the directory, or in a local
temporary directory for a store), then published under its name: renamed (after fsync) on a disk, uploaded
(retried, utils/object_store) to a store. So a name in the output always holds a complete file, and a prepare
cut short leaves nothing half written under a shard's name.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ConfigError
from ..utils import object_store


class WriteError(ConfigError):
    """The output could not be written: what was written so far stays, for --resume once the cause is fixed."""


def open_out(where: str) -> LocalOut | StoreOut:
    """The output --out names; ConfigError (one line) for a location that cannot be used."""
    if object_store.is_local(where):
        return LocalOut(where)
    if where.startswith("hdfs://"):
        _check_hdfs(where)
    return StoreOut(where)


def _check_hdfs(url: str) -> None:
    """fsspec reaches HDFS through pyarrow's HadoopFileSystem, which needs Java and libhdfs on this machine."""
    try:
        from pyarrow import fs as arrow_fs
    except ImportError:
        raise ConfigError(f"cannot use --out {url}: hdfs:// needs pyarrow (pip install 'minitrain[data]')") from None
    try:
        arrow_fs.HadoopFileSystem.from_uri(url)
    except Exception as e:  # noqa: BLE001 - pyarrow raises OSError or ArrowException, by what is missing
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"cannot use --out {url}: pyarrow's HadoopFileSystem is not available here ({reason}); "
                          "write to a local directory or s3:// and copy it over") from None


class LocalOut:
    """A directory on this machine; made (with its parents) when the first file is written."""

    def __init__(self, where: str):
        self.where = where
        path = where.removeprefix("file://")
        # abspath, not resolve: it spells out "." and ".." without following symlinks.
        self.root = Path(os.path.abspath(path))
        self.made: list[Path] = []  # directories this prepare made, outermost first
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"--out {where} is a file; choose another --out")

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()) if self.root.is_dir() else []

    def location(self, name: str) -> str:
        return str(Path(self.where) / name)

    def create(self) -> None:
        """mkdir -p, noting each directory as it is made, so that a failure half way still knows what to remove."""
        missing, directory = [], self.root
        while not directory.exists():
            missing.append(directory)
            directory = directory.parent
        try:
            for d in reversed(missing):
                d.mkdir()  # the umask's mode, as for any folder
                self.made.append(d)
        except OSError as e:
            raise WriteError(f"cannot write {self.where}: {e}") from None

    def temp_path(self, name: str) -> Path:
        return self.root / f".{name}.tmp"

    def local_path(self, name: str) -> Path:
        """A published file's path on this machine."""
        return self.root / name

    def publish(self, temp: Path, name: str) -> None:
        with _writing(self.where):
            with open(temp, "rb+") as f:
                os.fsync(f.fileno())  # its bytes on disk before its name: a name always holds the whole file
            os.replace(temp, self.root / name)

    def write_bytes(self, name: str, data: bytes) -> None:
        temp = self.temp_path(name)
        with _writing(self.where):
            temp.write_bytes(data)
        self.publish(temp, name)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def size(self, name: str) -> int | None:
        path = self.root / name
        return path.stat().st_size if path.is_file() else None

    def remove(self, name: str) -> None:
        with _writing(self.where):
            (self.root / name).unlink(missing_ok=True)

    def remove_temporaries(self) -> None:
        """What a prepare cut short left half written."""
        for path in self.root.glob(".*.tmp"):
            path.unlink(missing_ok=True)

    def discard(self, names: list[str]) -> None:
        """Remove `names`, the temporaries, and the directories this prepare made (a failed fresh prepare)."""
        if self.root.is_dir():
            for name in names:
                (self.root / name).unlink(missing_ok=True)
            self.remove_temporaries()
        for d in reversed(self.made):
            with contextlib.suppress(OSError):
                d.rmdir()

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _writing(where: str):
    try:
        yield
    except OSError as e:
        raise WriteError(f"cannot write {where}: {e}") from None


class StoreOut:
    """A prefix in an object store. Shards are written to a local temporary directory, then uploaded; the
    tokenizer keeps a local copy there too, for the workers to load."""

    def __init__(self, where: str):
        self.where = where.rstrip("/")
        self.fs, self.root = object_store.remote_store(where, "--out", ConfigError)
        self.temp = Path(tempfile.mkdtemp(prefix="minitrain-prepare-"))

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _retried(self, what: str, fn, error: type[Exception] = WriteError):
        try:
            return object_store.retried(f"{what} {self.where}", fn, error=error)
        except object_store.FINAL as e:  # the store's answer (no such bucket, no permission): no retry mends it
            raise error(f"{what} {self.where} failed: {type(e).__name__}: {e}") from None

    def names(self) -> list[str]:
        def listing():
            self.fs.invalidate_cache(self.root)  # a listing read afresh, not fsspec's remembered one
            try:
                return self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self._retried("listing", listing, ConfigError))

    def location(self, name: str) -> str:
        return f"{self.where}/{name}"

    def create(self) -> None:
        pass  # a store makes a prefix with its first object

    def temp_path(self, name: str) -> Path:
        return self.temp / name

    def local_path(self, name: str) -> Path:
        """The local copy of a file written with write_bytes (the tokenizer, for the workers)."""
        return self.temp / name

    def publish(self, temp: Path, name: str) -> None:
        self._retried(f"uploading {name} to", lambda: self.fs.put_file(str(temp), self._path(name)))
        temp.unlink()

    def write_bytes(self, name: str, data: bytes) -> None:
        self.local_path(name).write_bytes(data)
        self._retried(f"writing {name} to", lambda: self.fs.pipe_file(self._path(name), data))

    def read_bytes(self, name: str) -> bytes | None:
        def read():
            try:
                return self.fs.cat_file(self._path(name))
            except FileNotFoundError:
                return None
        data = self._retried(f"reading {name} from", read, ConfigError)
        if data is not None:
            self.local_path(name).write_bytes(data)
        return data

    def size(self, name: str) -> int | None:
        def info():
            try:
                return int(self.fs.info(self._path(name))["size"])
            except FileNotFoundError:
                return None
        return self._retried(f"reading the size of {name} in", info, ConfigError)

    def remove(self, name: str) -> None:
        def remove():
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._path(name))
        self._retried(f"removing {name} from", remove)

    def remove_temporaries(self) -> None:
        pass  # they live in this prepare's own temporary directory

    def discard(self, names: list[str]) -> None:
        for name in names:
            self.remove(name)

    def close(self) -> None:
        shutil.rmtree(self.temp, ignore_errors=True)
