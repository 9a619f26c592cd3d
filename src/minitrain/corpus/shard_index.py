"""The sharded corpus format: token shards and the index that says what they are, read and written here only.

A sharded corpus is a directory or a store prefix (s3://bucket/prefix) holding:
  train-00000.bin, ...  token ids, raw little-endian, no header (uint16 when every id fits, else uint32), each
  val-00000.bin, ...    at most --shard-mb; the val shards hold the held-out split
  tokenizer.json        the Hugging Face tokenizer that made them
  index.json            written last: what a reader trusts. A prepare cut short leaves no index, and nothing
                        reads a corpus without one.

index.json: {"format", "vocab_size", "dtype", "eot_id", "tokenizer", "val_fraction", "shard_bytes",
"documents", "sources": [{"path", "bytes", "documents"}], "shards": [{"name", "split", "tokens", "sha256"}]}.
A shard's sha256 is of its bytes, checked when it arrives from a store and before it is first read from disk.

Imports no `tokenizers` and no store client: training reads ids, and where they come from is store.py's part.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from . import token_files

INDEX = "index.json"
FORMAT = "minitrain-shards/1"
SPLITS = token_files.SPLITS
DTYPES = token_files.DTYPES
HEX = set("0123456789abcdef")


@dataclass(frozen=True)
class Shard:
    """One token file of a sharded corpus."""

    name: str  # a file name inside the corpus (no directory part)
    split: str  # "train" or "val"
    tokens: int
    sha256: str

    def nbytes(self, dtype: np.dtype) -> int:
        return self.tokens * dtype.itemsize


def shard_name(split: str, number: int) -> str:
    """The file name of a split's shard number `number`."""
    return f"{split}-{number:05d}.bin"


def sha256_of(data) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


@dataclass(frozen=True)
class ShardIndex:
    """A corpus's index.json, checked; `where` is the corpus's location as the user gave it (for messages)."""

    where: str
    meta: dict
    shards: tuple[Shard, ...]

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.meta["dtype"]]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def split(self, split: str) -> tuple[Shard, ...]:
        return tuple(s for s in self.shards if s.split == split)

    def fingerprint(self, split: str = "train") -> str:
        """sha256 over the split's shards (names, sizes and hashes, in order): the same tokens, the same value,
        without reading them. A resume must continue on the same data."""
        listing = [[s.name, s.tokens, s.sha256] for s in self.split(split)]
        return hashlib.sha256(json.dumps(listing).encode()).hexdigest()

    def to_json(self) -> str:
        shards = [{"name": s.name, "split": s.split, "tokens": s.tokens, "sha256": s.sha256} for s in self.shards]
        return json.dumps({**self.meta, "format": FORMAT, "shards": shards}, indent=1) + "\n"


# index.json's keys besides "shards", and the types each value must have (bool is excluded from int below).
META_KEYS: dict[str, tuple[type, ...]] = {
    "format": (str,), "vocab_size": (int,), "dtype": (str,), "eot_id": (int, type(None)), "tokenizer": (str,),
    "val_fraction": (float, int), "shard_bytes": (int,), "documents": (int,), "sources": (list,),
    "shards": (list,),
}


def parse_index(text: str, where: str) -> ShardIndex:
    """index.json's text, checked field by field; ConfigError (one line, naming `where`) if it is not sound."""
    path = f"{where.rstrip('/')}/{INDEX}"
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not JSON ({e.msg} at line {e.lineno}); prepare the corpus again") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} is not a JSON object; prepare the corpus again")
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}; prepare the corpus "
                          "again with this minitrain")
    for key, types in META_KEYS.items():
        if key not in meta:
            raise ConfigError(f"{path} lacks {key}; prepare the corpus again")
        if not isinstance(meta[key], types) or isinstance(meta[key], bool):
            raise ConfigError(f"{path}: {key} is {meta[key]!r}, of the wrong type; prepare the corpus again")
    if meta["dtype"] not in DTYPES or token_files.dtype_for(max(meta["vocab_size"], 1)).name != meta["dtype"]:
        raise ConfigError(f"{path}: dtype {meta['dtype']!r} does not go with vocab_size {meta['vocab_size']}")
    shards = tuple(_shard(entry, path) for entry in meta.pop("shards"))
    names = [s.name for s in shards]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path} lists a shard twice; prepare the corpus again")
    for split in SPLITS:
        if sum(s.tokens for s in shards if s.split == split) < token_files.MIN_SPLIT_TOKENS:
            raise ConfigError(f"{path}: the {split} split holds fewer than {token_files.MIN_SPLIT_TOKENS} tokens")
    return ShardIndex(where, meta, shards)


def _shard(entry, path: str) -> Shard:
    if not isinstance(entry, dict) or set(entry) != {"name", "split", "tokens", "sha256"}:
        raise ConfigError(f"{path}: a shard entry is not {{name, split, tokens, sha256}}: {entry!r}")
    name, split, tokens, digest = entry["name"], entry["split"], entry["tokens"], entry["sha256"]
    if not isinstance(name, str) or not name.endswith(".bin") or "/" in name or "\\" in name or name.startswith("."):
        raise ConfigError(f"{path}: shard name {name!r} must be a .bin file inside the corpus itself")
    if split not in SPLITS:
        raise ConfigError(f"{path}: shard {name} has split {split!r}, not one of {', '.join(SPLITS)}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ConfigError(f"{path}: shard {name} has {tokens!r} tokens; expected a positive integer")
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= HEX:
        raise ConfigError(f"{path}: shard {name} has no sha256 of 64 hex digits")
    return Shard(name, split, tokens, digest)
