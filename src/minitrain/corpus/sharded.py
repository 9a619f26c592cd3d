"""A run's sharded corpus, from its settings: which --corpus values name one, what it holds (checked before the
run), its loader, and its held-out split. data.py asks here for every corpus of this kind."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config.data import corpus_list, store_timeout_s, weight_list
from ..utils.object_store import is_url
from .shard_cache import ShardCache
from .shard_index import INDEX, ShardIndex
from .store import DataError
from .token_shards import TokenShards, check_one_tokenizer, load_index, mixture_fingerprint, windows_in

if TYPE_CHECKING:
    from ..config import RunConfig

CACHE_DIR = "data_cache"  # under OUT unless --data.cache_dir says otherwise


def _timeout(cfg: RunConfig) -> float:
    return store_timeout_s(cfg.data, cfg.dist.timeout_s)


def is_sharded(corpus: str) -> bool:
    """--corpus names a sharded corpus (or a mixture of them): a store URL, several comma-separated, or a
    directory holding index.json."""
    names = [c.strip() for c in corpus.split(",")]
    return len(names) > 1 or is_url(corpus) or (Path(corpus) / INDEX).is_file()


def indexes(cfg: RunConfig) -> list[ShardIndex]:
    """Each corpus's checked index, read from where it lies (one request to a store); DataError otherwise."""
    out, loaded = [], []
    for location in corpus_list(cfg.data):
        if not is_url(location) and not (Path(location) / INDEX).is_file():
            raise DataError(f"--corpus {location}: a mixture's corpora are each a directory or store prefix from "
                            f"`minitrain data prepare` (with {INDEX}); this one has none")
        store, index = load_index(location, _timeout(cfg))
        check_present(store, index)
        out.append(index)
        loaded.append((store, index))
    check_one_tokenizer(corpus_list(cfg.data), loaded)
    vocabs = {i.vocab_size for i in out}
    if len(vocabs) > 1:
        raise DataError(f"the corpora of --corpus {cfg.data.corpus} have different vocabularies "
                        f"({', '.join(str(i.vocab_size) for i in out)}); prepare them with one --tokenizer")
    return out


def check_present(store, index: ShardIndex) -> None:
    """Every shard the index lists is there at its size (a listing, before the run: a missing or cut shard is
    named before anything is written; the sha256 is checked when a shard is first read)."""
    sizes = store.sizes()
    for shard in index.shards:
        if shard.name not in sizes:
            raise DataError(f"{store.describe(shard.name)} is missing: the corpus's index.json lists it; restore it "
                            "or prepare the corpus again")
        if sizes[shard.name] != shard.nbytes(index.dtype):
            raise DataError(f"{store.describe(shard.name)} has {sizes[shard.name]} bytes, the index says "
                            f"{shard.nbytes(index.dtype)}: a truncated or replaced shard; restore it or prepare the "
                            "corpus again")


def examples(index: ShardIndex, split: str, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens in a split's shards (windows never cross shards)."""
    return sum(windows_in(s, seq_len) for s in index.split(split))


def facts(cfg: RunConfig) -> tuple[int, int]:
    """(training examples over every corpus, the vocabulary they need)."""
    found = indexes(cfg)
    for location, index in zip(corpus_list(cfg.data), found):
        if examples(index, "train", cfg.model.seq_len) == 0:
            raise DataError(f"--corpus {location} holds no training example of {cfg.model.seq_len + 1} tokens in "
                            "any shard; use a shorter --seq-len or larger shards")
    return sum(examples(i, "train", cfg.model.seq_len) for i in found), found[0].vocab_size


def fingerprint(cfg: RunConfig) -> str:
    return mixture_fingerprint(indexes(cfg), weight_list(cfg.data))


def cache_dir(cfg: RunConfig) -> Path:
    return Path(cfg.data.cache_dir or os.path.join(cfg.out, CACHE_DIR))


def loader(cfg: RunConfig, rank: int, world_size: int, prefetch: int, pin_memory: bool) -> TokenShards:
    d = cfg.data
    return TokenShards(corpus_list(d), cfg.model.seq_len, cfg.train.batch_size, rank=rank, world_size=world_size,
                       seed=cfg.train.seed, weights=weight_list(d), cache_dir=cache_dir(cfg),
                       cache_mb=d.cache_mb or None, prefetch=prefetch, store_timeout_s=_timeout(cfg),
                       pin_memory=pin_memory)


def val_tokens(cfg: RunConfig, needed: int | None = None) -> np.ndarray:
    """The first corpus's held-out tokens: its val shards in order, concatenated, only as many shards as reach
    `needed` tokens (all of them when None); fetched through the cache for a store."""
    location = corpus_list(cfg.data)[0]
    store, index = load_index(location, _timeout(cfg))
    shards, total = [], 0
    for shard in index.split("val"):
        if needed is not None and total >= needed:
            break
        shards.append(shard)
        total += shard.tokens
    cache = ShardCache(store, index, cache_dir(cfg) / "val", sum(s.nbytes(index.dtype) for s in shards))
    return np.concatenate([np.asarray(cache.open(s)) for s in shards])


def val_token_count(cfg: RunConfig) -> int:
    index = load_index(corpus_list(cfg.data)[0], _timeout(cfg))[1]
    return sum(s.tokens for s in index.split("val"))
