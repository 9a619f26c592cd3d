"""Shards on this machine's disk, verified, for the loader to memory-map.

A local corpus's shards are read where they lie; a store's are copied into a cache directory first, holding at
most cache_bytes of them, the least recently used evicted first. Either way a shard is checked before this
process first reads it: its size against the index (a truncated file is fetched again from a store, refused on
a local disk), its sha256 (an altered shard stops the run, naming it) and its largest id against the index's
vocabulary (an id past the model's embedding would fail deep inside a rank). Shards the loader is using or is
about to use (`keep`) are never evicted.

Ranks of one machine may share the cache directory: a shard arrives under a temporary name and is renamed
into place once verified, so a reader sees it whole or not at all; a file another rank is reading may be
evicted (its pages stay readable until unmapped), at worst costing a second fetch.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from .shard_index import Shard, ShardIndex
from .store import CorpusStore, DataError, disk_full

HASH_CHUNK = 1 << 24  # bytes hashed at a time: a shard is hashed without being held in memory


class ShardCache:
    def __init__(self, store: CorpusStore, index: ShardIndex, cache_dir: str | Path | None, cache_bytes: int):
        self.store, self.index, self.dtype = store, index, index.dtype
        self.cache_bytes = cache_bytes
        self.dir = None if store.local_path("") is not None else Path(cache_dir or ".")
        if self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DataError(f"cannot use --data.cache_dir {self.dir}: {e.strerror or e}") from None
        self.verified: set[str] = set()
        self.keep: set[str] = set()
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.fetched_bytes = 0  # what came from the store (a report's figure)

    def path(self, shard: Shard) -> Path:
        local = self.store.local_path(shard.name)
        return local if local is not None else self.dir / shard.name

    def open(self, shard: Shard) -> np.memmap:
        """The shard's tokens, memory-mapped read-only, after it is here and verified."""
        self.ensure(shard)
        path = self.path(shard)
        os.utime(path)  # recently used: the eviction order
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(shard.tokens,))

    def ensure(self, shard: Shard) -> None:
        """The shard here and verified (fetched and hashed if this process has not yet); the fetch thread calls
        it ahead of the step, the loader when it reads."""
        with self._lock(shard.name):
            if shard.name in self.verified:
                if self.path(shard).is_file():
                    return
                self.verified.discard(shard.name)  # evicted (by this process or a sibling rank) since
            if self.dir is None:
                self._verify_local(shard)
            else:
                self._arrive(shard)
            self._check_ids(shard)
            self.verified.add(shard.name)

    def _lock(self, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(name, threading.Lock())

    def _verify_local(self, shard: Shard) -> None:
        path = self.path(shard)
        if not path.is_file():
            raise DataError(f"{self.store.describe(shard.name)} is missing: the corpus's index.json lists it; "
                            "restore it or prepare the corpus again")
        size, expected = path.stat().st_size, shard.nbytes(self.dtype)
        if size != expected:
            raise DataError(f"{self.store.describe(shard.name)} has {size} bytes, the index says {expected}: a "
                            "truncated or replaced shard; restore it or prepare the corpus again")
        if _sha256(path) != shard.sha256:
            raise DataError(f"{self.store.describe(shard.name)} does not match its sha256 in index.json: the shard "
                            "was altered; restore it or prepare the corpus again")

    def _check_ids(self, shard: Shard) -> None:
        top = int(np.memmap(self.path(shard), dtype=self.dtype, mode="r", shape=(shard.tokens,)).max())
        if top >= self.index.vocab_size:
            raise DataError(f"{self.store.describe(shard.name)} holds token id {top}, beyond the vocabulary of "
                            f"{self.index.vocab_size} that index.json states; prepare the corpus again")

    def _arrive(self, shard: Shard) -> None:
        """A cached copy is reused when whole and sound; otherwise the shard is fetched again."""
        path, expected = self.path(shard), shard.nbytes(self.dtype)
        if path.is_file():
            if path.stat().st_size == expected and _sha256(path) == shard.sha256:
                return
            path.unlink(missing_ok=True)  # truncated or damaged in the cache: the store's copy is the truth
        try:
            self._fetch(shard, path)
        except OSError as e:
            if not disk_full(e):
                raise DataError(f"cannot write {path} (the data cache): {e.strerror or e}") from None
            self._evict(everything=True)
            try:
                self._fetch(shard, path)
            except OSError as again:
                raise DataError(f"the data cache {self.dir} is out of disk space ({again.strerror or again}) even "
                                "after evicting every shard not in use: free space there, point --data.cache_dir at "
                                "a larger disk, or lower --data.cache_mb") from None

    def _fetch(self, shard: Shard, path: Path) -> None:
        self._evict(room_for=shard.nbytes(self.dtype))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.store.fetch(shard.name, tmp)
            size = tmp.stat().st_size
            if size != shard.nbytes(self.dtype) or _sha256(tmp) != shard.sha256:
                raise DataError(f"{self.store.describe(shard.name)} does not match index.json ({size} bytes, the "
                                f"index says {shard.nbytes(self.dtype)}, or another sha256): the shard was altered "
                                "in the store; restore it or prepare the corpus again")
            os.replace(tmp, path)
            self.fetched_bytes += size
        finally:
            tmp.unlink(missing_ok=True)

    def cached_bytes(self) -> int:
        """Bytes of whole shards in the cache directory now (0 for a local corpus, which has none)."""
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        if self.dir is None:
            return out
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".bin") and not entry.name.startswith("."):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # evicted by a sibling rank meanwhile
                out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def _evict(self, room_for: int = 0, everything: bool = False) -> None:
        """Least recently used shards out until room_for more bytes fit the budget (or all of them), except the
        ones in use."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if not everything and total + room_for <= self.cache_bytes:
                return
            if path.name in self.keep:
                continue
            path.unlink(missing_ok=True)
            self.verified.discard(path.name)
            total -= size


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
