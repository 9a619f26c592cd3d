"""The data section: the corpus a run reads, how a mixture of corpora is weighted, where a store's shards are
kept, and how many batches are made ahead of the step."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .fields import check_seed, opt, require_non_negative


@dataclass
class DataConfig:
    corpus: str = opt("synthetic", "synthetic | text (the shipped byte-level prose) | a corpus from `minitrain data "
                      "prepare`: a directory or a store prefix (s3://bucket/prefix) holding index.json and its token "
                      "shards | several of them, comma-separated, mixed by --data.weights | a nanoGPT-style uint16 "
                      ".bin token file (a val.bin beside it is its held-out split)")
    weights: str = opt("", "a mixture's weights, one per corpus of --corpus A,B (e.g. 0.7,0.3): each example of a "
                       "global batch comes from corpus k with probability weight k")
    cache_dir: str = opt("", "where shards fetched from a store are kept on this machine (default OUT/data_cache)")
    cache_mb: float = opt(0.0, "at most this many MB of fetched shards in the cache, least recently used out; 0 = "
                          "two shuffle blocks of each corpus (the block read and the next, fetched ahead)")
    store_timeout_s: float = opt(0.0, "a store that does not answer is retried with backoff for this long before "
                                 "the run stops (exit 2; resume once it is back); less than --dist.timeout_s, which "
                                 "the other ranks wait in a collective meanwhile; 0 = 0.8 x --dist.timeout_s")
    synthetic_tokens: int = opt(65536, "length of the synthetic corpus in tokens")
    corpus_seed: int = opt(0, "seed that generates the synthetic corpus (the data order uses train.seed)")
    prefetch: int = opt(2, "batches a background thread makes ahead while the step runs (pinned for a GPU's "
                        "asynchronous copy); the same batches in the same order; 0 = each made in the step")


def corpus_list(d: DataConfig) -> list[str]:
    """The corpora --corpus names (one, or several comma-separated)."""
    return [c.strip() for c in d.corpus.split(",")]


def weight_list(d: DataConfig) -> list[float] | None:
    """--data.weights as numbers (None when not given); ConfigError for anything else."""
    if not d.weights.strip():
        return None
    try:
        return [float(w) for w in d.weights.split(",")]
    except ValueError:
        raise ConfigError(f"--data.weights must be numbers separated by commas (e.g. 0.7,0.3), got "
                          f"{d.weights!r}") from None


def store_timeout_s(d: DataConfig, pg_timeout_s: float) -> float:
    """How long a read from a store is retried: --data.store_timeout_s, or 80% of the process group's timeout (a
    rank waiting for its data holds the others in their next collective)."""
    return d.store_timeout_s or 0.8 * pg_timeout_s


def check_data(d: DataConfig) -> None:
    check_seed("--data.corpus_seed", d.corpus_seed)
    require_non_negative("data.prefetch", d.prefetch)
    require_non_negative("data.cache_mb", d.cache_mb)
    require_non_negative("data.store_timeout_s", d.store_timeout_s)
    corpora, weights = corpus_list(d), weight_list(d)
    if any(not c for c in corpora):
        raise ConfigError(f"--corpus {d.corpus!r} has an empty name between its commas")
    if len(corpora) > 1 and weights is None:
        raise ConfigError(f"--corpus names {len(corpora)} corpora: give one weight each with --data.weights (e.g. "
                          f"{','.join(['1'] * len(corpora))})")
    if weights is not None:
        if len(weights) != len(corpora):
            raise ConfigError(f"--data.weights has {len(weights)} weights for {len(corpora)} corpora; give one each")
        if not all(w > 0 and w != float("inf") for w in weights):
            raise ConfigError(f"--data.weights must all be positive and finite, got {d.weights}")
