"""The token stream cut into shards, and the journal that lets a prepare cut short continue where it stopped.

The stream (each document's ids, then the end-of-text id) is cut into blocks of B = shard_bytes // itemsize
tokens. Block k becomes train shard k (its first B - round(F x B) tokens) and val shard k (the rest, F being
--val-fraction); the last, partial block of L tokens is split the same way with round(F x L). So the split needs
no total up front, every shard is at most shard_bytes, val is spread through the whole corpus, and a single
document still gives both splits. A split part of 0 tokens writes no file.

After each block's shards are published, the journal (prepare.json) is rewritten: the shards so far, how many
documents the blocks have consumed whole, and how many tokens of the next document they hold already. --resume
starts a fresh block there, and since a block's shards depend on nothing but the stream, it writes what an
uninterrupted prepare would have.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from .shard_index import Shard, shard_name

JOURNAL = "prepare.json"
JOURNAL_FORMAT = "minitrain-prepare-journal/1"
HASH_CHUNK = 1 << 24  # bytes read at a time when a shard is hashed again from its file


def split_of(tokens: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) tokens of a block of `tokens`."""
    val = round(tokens * val_fraction)
    return tokens - val, val


class _Part:
    """One split's shard of the current block, written to a temporary file and hashed as it grows."""

    def __init__(self, out, split: str, number: int):
        self.name = shard_name(split, number)
        self.split, self.out, self.tokens = split, out, 0
        self.temp = out.temp_path(self.name)
        self.file = open(self.temp, "wb")  # noqa: SIM115 - closed by finish()
        self.hash = hashlib.sha256()

    def add(self, data: memoryview, tokens: int) -> None:
        self.file.write(data)
        self.hash.update(data)
        self.tokens += tokens

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()

    def finish(self) -> Shard | None:
        """Publish the shard (or, empty, drop its file); its index entry."""
        self.close()
        if not self.tokens:
            self.temp.unlink(missing_ok=True)
            return None
        self.out.publish(self.temp, self.name)
        return Shard(self.name, self.split, self.tokens, self.hash.hexdigest())


class ShardWriter:
    """Takes the token stream a piece at a time (at most `room` tokens each) and writes it as shards to `out`
    (prepare_out's LocalOut or StoreOut), starting at block `first_block`."""

    def __init__(self, out, dtype: np.dtype, block_tokens: int, val_fraction: float, first_block: int = 0):
        self.out, self.dtype, self.val_fraction = out, dtype, val_fraction
        self.block_tokens = block_tokens
        self.train_part, _ = split_of(block_tokens, val_fraction)
        self.block = first_block  # the number of the block being written; blocks before it are done
        self.parts: dict[str, _Part] = {}
        self.filled = 0  # tokens of the current block written so far

    @property
    def room(self) -> int:
        return self.block_tokens - self.filled

    def add(self, tokens: np.ndarray) -> None:
        """Append `tokens` (of the writer's dtype, at most `room` of them) to the current block."""
        assert len(tokens) <= self.room
        to_train = min(len(tokens), max(0, self.train_part - self.filled))
        for split, piece in (("train", tokens[:to_train]), ("val", tokens[to_train:])):
            if len(piece):
                if split not in self.parts:
                    self.parts[split] = _Part(self.out, split, self.block)
                self.parts[split].add(memoryview(np.ascontiguousarray(piece)).cast("B"), len(piece))
        self.filled += len(tokens)

    def end_block(self) -> list[Shard]:
        """Publish the current block's shards (a partial block, the stream's last, split by its own length);
        their index entries, train first."""
        if self.filled < self.block_tokens:
            self._resplit()
        shards = [shard for split in ("train", "val") if split in self.parts
                  for shard in [self.parts[split].finish()] if shard is not None]
        self.parts, self.filled = {}, 0
        self.block += 1
        return shards

    def _resplit(self) -> None:
        """A partial block's train part is shorter than a full block's: the surplus train tokens (never more than
        round(F x L) of them, so at most half the block) move to the head of its val part, and both are hashed
        again from their files."""
        train_tokens, _ = split_of(self.filled, self.val_fraction)
        train = self.parts.get("train")
        surplus = (train.tokens if train else 0) - train_tokens
        if surplus <= 0:
            return
        itemsize = self.dtype.itemsize
        train.close()
        with open(train.temp, "rb+") as f:
            f.seek(train_tokens * itemsize)
            moved = f.read()
            f.truncate(train_tokens * itemsize)
        val = self.parts.get("val") or _Part(self.out, "val", self.block)
        val.close()
        rest = val.temp.read_bytes()
        val.temp.write_bytes(moved + rest)
        train.tokens, val.tokens = train_tokens, surplus + val.tokens
        self.parts["val"] = val
        for part in (train, val):
            part.hash = _file_hash(part.temp)

    def close(self) -> None:
        for part in self.parts.values():
            part.close()


def _file_hash(path) -> hashlib._Hash:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest


# ---- the journal -------------------------------------------------------------------------------------------


@dataclass
class Journal:
    """prepare.json: the arguments a prepare runs with, and how far its blocks have come."""

    fingerprint: dict  # the inputs and their sizes, the tokenizer's sha256, and the options that shape the output
    tokenizer_sha256: str  # of the tokenizer.json written into the output
    blocks: int = 0  # blocks written whole
    documents: int = 0  # documents those blocks consumed whole
    offset: int = 0  # tokens of the next document that they hold already
    shards: list[Shard] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"format": JOURNAL_FORMAT, "fingerprint": self.fingerprint,
                           "tokenizer_sha256": self.tokenizer_sha256, "blocks": self.blocks,
                           "documents": self.documents, "offset": self.offset,
                           "shards": [[s.name, s.split, s.tokens, s.sha256] for s in self.shards]}, indent=1) + "\n"

    @classmethod
    def parse(cls, data: bytes, where: str) -> Journal:
        try:
            raw = json.loads(data)
            if raw.get("format") != JOURNAL_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}")
            journal = cls(dict(raw["fingerprint"]), str(raw["tokenizer_sha256"]), int(raw["blocks"]),
                          int(raw["documents"]), int(raw["offset"]),
                          [Shard(str(n), str(s), int(t), str(h)) for n, s, t, h in raw["shards"]])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{where} is not a journal this minitrain can resume from ({e}); start again in an "
                              "empty --out") from None
        return journal


# Each fingerprint entry, as a message names it.
OPTIONS = {"inputs": "the inputs", "vocab_size": "--vocab-size", "tokenizer": "--tokenizer (its sha256)",
           "shard_bytes": "--shard-mb (in bytes)", "val_fraction": "--val-fraction", "text_field": "--text-field"}


def difference(now: dict, then: dict) -> str | None:
    """What differs between two fingerprints, in words; None if nothing does."""
    for key, label in OPTIONS.items():
        if now.get(key) == then.get(key):
            continue
        if key != "inputs" or not isinstance(then.get(key), list):
            return f"{label} is {now.get(key)!r}, was {then.get(key)!r}"
        for (path, size), old in zip(now[key], then[key]):
            if [path, size] != list(old):
                return f"input {path} ({size:,} bytes) was {old[0]} ({old[1]:,} bytes)"
        return f"{len(now[key])} inputs, were {len(then[key])}"
    extra = set(then) - set(now)
    return f"the journal records {', '.join(sorted(extra))}" if extra else None
