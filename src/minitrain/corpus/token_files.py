"""The on-disk format of a tokenized corpus, read and written here and nowhere else.

A corpus directory, as `minitrain data prepare` writes it:
  train.bin, val.bin  token ids, raw little-endian, no header (nanoGPT's layout): uint16 when every id fits
                      (vocab_size <= 65536), else uint32; val.bin is the tail of the token stream;
  tokenizer.json      the Hugging Face tokenizer that made them;
  meta.json           what a reader needs to trust the rest: FORMAT, vocab_size, dtype, token counts, eot_id, ...

Imports no `tokenizers`: training reads token ids only.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import ConfigError

META = "meta.json"
FORMAT = "minitrain-tokens/1"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
MIN_SPLIT_TOKENS = 2  # one (input, target) pair; `data prepare` refuses a split with fewer

# meta.json's keys and the types each value must have (bool is excluded from int below).
META_KEYS: dict[str, tuple[type, ...]] = {
    "format": (str,), "vocab_size": (int,), "dtype": (str,), "train_tokens": (int,), "val_tokens": (int,),
    "val_fraction": (float, int), "tokenizer": (str,), "eot_id": (int, type(None)), "documents": (int,),
    "sources": (list,),
}
TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", list: "a list", type(None): "null"}


def dtype_for(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned type that holds every id below vocab_size."""
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be between 1 and 2**32, got {vocab_size}")
    return DTYPES["uint16"] if vocab_size <= 2**16 else DTYPES["uint32"]


def split_path(directory: str | Path, split: str) -> Path:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return Path(directory) / f"{split}.bin"


def is_prepared_dir(path: str | Path) -> bool:
    """A directory holding meta.json: `minitrain data prepare` output (read_meta says whether it is sound)."""
    path = Path(path)
    return path.is_dir() and (path / META).is_file()


def write_split(path, tokens: np.ndarray, dtype) -> int:
    """Write `tokens` to `path` (a file name, or a binary file open for writing, which it appends to) as raw
    little-endian `dtype` ids; returns how many. Refuses ids the dtype cannot hold rather than let them wrap
    around silently."""
    dtype = np.dtype(dtype).newbyteorder("<")
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids span {tokens.min()}..{tokens.max()}, beyond what {dtype.name} holds")
    tokens.astype(dtype, copy=False).tofile(path)
    return int(tokens.size)


def _is(value, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and not isinstance(value, bool)


def _load_meta_json(directory: Path) -> dict:
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory; a tokenized corpus is the directory `minitrain data "
                          "prepare` writes")
    try:
        text = (directory / META).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{directory} holds no {META}: it is not a corpus from `minitrain data prepare`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {directory / META}: {e}") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{directory / META} is not JSON ({e.msg} at line {e.lineno}); prepare the corpus "
                          "again") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{directory / META} is not a JSON object; prepare the corpus again")
    return meta


def _check_fields(path: Path, meta: dict) -> None:
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}; prepare the corpus "
                          "again with this minitrain")
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(missing)}; prepare the corpus again")
    for key, types in META_KEYS.items():
        if not _is(meta[key], types):
            expected = " or ".join(TYPE_NAMES[t] for t in types)
            raise ConfigError(f"{path}: {key} is {meta[key]!r}, not {expected}; prepare the corpus again")
    if meta["dtype"] not in DTYPES:
        raise ConfigError(f"{path}: dtype {meta['dtype']!r} is not one of {', '.join(DTYPES)}")
    if not 1 <= meta["vocab_size"] <= 2**32 or dtype_for(meta["vocab_size"]).name != meta["dtype"]:
        raise ConfigError(f"{path}: vocab_size {meta['vocab_size']} does not go with dtype {meta['dtype']}")
    if meta["eot_id"] is not None and not 0 <= meta["eot_id"] < meta["vocab_size"]:
        raise ConfigError(f"{path}: eot_id {meta['eot_id']} lies outside the vocabulary of {meta['vocab_size']}")
    name = meta["tokenizer"]
    if not name or Path(name).name != name or name in (".", ".."):
        raise ConfigError(f"{path}: tokenizer {name!r} must name a file in the corpus directory itself")
    if not (path.parent / name).is_file():
        raise ConfigError(f"{path.parent / name} (the corpus's tokenizer) is missing; prepare the corpus again")


def _check_bins(directory: Path, meta: dict) -> None:
    itemsize = DTYPES[meta["dtype"]].itemsize
    for split in SPLITS:
        count, path = meta[f"{split}_tokens"], split_path(directory, split)
        if count < MIN_SPLIT_TOKENS:
            raise ConfigError(f"{directory / META}: {split}_tokens is {count}, fewer than {MIN_SPLIT_TOKENS}")
        if not path.is_file():
            raise ConfigError(f"{path} is missing; prepare the corpus again")
        size, expected = path.stat().st_size, count * itemsize
        if size != expected:
            raise ConfigError(f"{path} has {size} bytes, but {META} says {count} {meta['dtype']} tokens "
                              f"({expected} bytes): a truncated or replaced file; prepare the corpus again")


def read_meta(directory: str | Path) -> dict:
    """meta.json of a corpus directory, checked against the files beside it; ConfigError (one line) if the
    directory is not a sound corpus."""
    directory = Path(directory)
    meta = _load_meta_json(directory)
    _check_fields(directory / META, meta)
    _check_bins(directory, meta)
    return meta


def check_ids(directory: str | Path) -> None:
    """Every token id of both splits lies inside meta.json's vocabulary (one pass over the files; run once,
    before training: an id beyond the model's embedding would fail deep inside a rank)."""
    meta = read_meta(directory)
    for split in SPLITS:
        tokens = open_split(directory, split)
        top = int(tokens.max())
        if top >= meta["vocab_size"]:
            raise ConfigError(f"{split_path(directory, split)} holds token id {top}, beyond the vocabulary of "
                              f"{meta['vocab_size']} that {Path(directory) / META} states; prepare the corpus again")


def open_split(directory: str | Path, split: str) -> np.memmap:
    """The `split` ("train" or "val") tokens, memory-mapped read-only: pages load as batches touch them."""
    path = split_path(directory, split)
    meta = read_meta(directory)
    return np.memmap(path, dtype=DTYPES[meta["dtype"]], mode="r", shape=(meta[f"{split}_tokens"],))
