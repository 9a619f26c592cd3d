"""Sharded corpora for the loader's tests, written directly in the format of corpus/shard_index.py (what `minitrain
data prepare` writes), with token ids drawn from a seed, so a test controls shard sizes exactly."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from minitrain.corpus.shard_index import Shard, ShardIndex, sha256_of, shard_name
from minitrain.corpus.tokenizer import byte_level_tokenizer


def write_corpus(root: str | Path, train: list[int], val: list[int] = (64,), vocab: int = 256, seed: int = 0,
                 fs=None) -> ShardIndex:
    """Shards of the given token counts into `root` (a directory, or a path inside fsspec filesystem `fs`), the
    tokenizer, and index.json last. Returns the index."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype("<u2") if vocab <= 2**16 else np.dtype("<u4")
    shards = []
    for split, counts in (("train", train), ("val", val)):
        for number, count in enumerate(counts):
            data = rng.integers(0, vocab, count).astype(dtype).tobytes()
            name = shard_name(split, number)
            _put(root, name, data, fs)
            shards.append(Shard(name, split, count, sha256_of(data)))
    meta = {"vocab_size": vocab, "dtype": dtype.name, "eot_id": None, "tokenizer": "tokenizer.json",
            "val_fraction": 0.1, "shard_bytes": max(train) * dtype.itemsize, "documents": 1,
            "sources": [{"path": "generated", "bytes": 0, "documents": 1}]}
    index = ShardIndex(str(root), meta, tuple(shards))
    _put(root, "tokenizer.json", byte_level_tokenizer().to_str().encode(), fs)
    _put(root, "index.json", index.to_json().encode(), fs)
    return index


def _put(root, name: str, data: bytes, fs) -> None:
    if fs is None:
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / name).write_bytes(data)
    else:
        fs.pipe_file(f"{str(root).removeprefix('s3://').rstrip('/')}/{name}", data)
