"""The data section: the corpus a run reads and how many batches are made ahead of the step."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import check_seed, opt, require_non_negative


@dataclass
class DataConfig:
    corpus: str = opt("synthetic", "synthetic | text (the shipped byte-level prose) | a directory written by "
                      "`minitrain data prepare` (train.bin, val.bin, tokenizer.json, meta.json) | a nanoGPT-style "
                      "uint16 .bin token file (a val.bin beside it is its held-out split)")
    synthetic_tokens: int = opt(65536, "length of the synthetic corpus in tokens")
    corpus_seed: int = opt(0, "seed that generates the synthetic corpus (the data order uses train.seed)")
    prefetch: int = opt(2, "batches a background thread makes ahead while the step runs (pinned for a GPU's "
                        "asynchronous copy); the same batches in the same order; 0 = each made in the step")


def check_data(d: DataConfig) -> None:
    check_seed("--data.corpus_seed", d.corpus_seed)
    require_non_negative("data.prefetch", d.prefetch)
