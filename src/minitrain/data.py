"""Corpora, a byte-level tokenizer, and deterministic rank sharding.

A corpus is a 1-D array of token ids. Example i is the window
tokens[i*T : i*T + T + 1] (inputs are the first T tokens, targets the last T),
so examples tile the corpus without overlap except for the shared boundary token.

Sharding (ShardedLoader): each epoch the examples are put in an order drawn
from (seed, epoch), identical on every rank; position p of that order goes to
rank p % world_size. One micro-batch consumes batch_size * world_size
positions, so every rank takes the same number of steps, ranks never overlap,
and the *global* batch at a given step is the same whatever the world size
(world 1 with batch 4N sees exactly what world N with batch 4 sees together).
Positions left over at the end of an epoch (fewer than one global batch) are
dropped for that epoch.
"""
from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .errors import ConfigError

if TYPE_CHECKING:  # the type only: config imports this module to validate a run's corpus
    from .config import RunConfig

TEXT_CORPUS = "field_notes.txt"


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless, no training needed."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def make_corpus(seed: int, total_tokens: int, vocab_size: int = 64) -> np.ndarray:
    """Deterministic synthetic tokens with learnable structure.

    A sparse Markov chain: every token has three possible successors, taken
    with probability 0.7 / 0.2 / 0.1. A model that learns the table reaches a
    loss near the chain's entropy (about 0.8 nats) from ln(vocab) at init, so
    the loss visibly falls within a few steps.
    """
    if total_tokens < 1 or vocab_size < 2:
        raise ValueError("need total_tokens >= 1 and vocab_size >= 2")
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, 3))
    choice = rng.choice(3, size=total_tokens, p=[0.7, 0.2, 0.1])
    tokens = np.empty(total_tokens, dtype=np.uint16)
    tok = int(rng.integers(0, vocab_size))
    for i in range(total_tokens):
        tokens[i] = tok
        tok = int(successors[tok, choice[i]])
    return tokens


def text_corpus() -> np.ndarray:
    """The small prose corpus shipped with the package, byte-tokenized."""
    text = resources.files("minitrain").joinpath("corpora", TEXT_CORPUS).read_text(encoding="utf-8")
    return ByteTokenizer().encode(text)


def bin_corpus(path: str | Path) -> np.ndarray:
    """A nanoGPT-style file of uint16 token ids, memory-mapped: pages load as batches touch them."""
    return np.memmap(path, dtype=np.uint16, mode="r")


def load_corpus(cfg: RunConfig) -> np.ndarray:
    d = cfg.data
    if d.corpus == "synthetic":
        return make_corpus(d.corpus_seed, d.synthetic_tokens, cfg.model.vocab_size)
    if d.corpus == "text":
        return text_corpus()
    return bin_corpus(d.corpus)


def corpus_fingerprint(tokens: np.ndarray) -> str:
    """sha256 of the corpus's tokens as they are trained on: a resume must continue on the same data."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(tokens))).hexdigest()


def _corpus_facts(cfg: RunConfig) -> tuple[int, int]:
    """(tokens in the corpus, vocabulary it needs), or ConfigError if it cannot be read."""
    d = cfg.data
    if d.corpus == "synthetic":
        if d.synthetic_tokens < 2:
            raise ConfigError(f"data.synthetic_tokens must be at least 2, got {d.synthetic_tokens}")
        return d.synthetic_tokens, 2
    if d.corpus == "text":
        return len(text_corpus()), ByteTokenizer.vocab_size
    path = Path(d.corpus)
    if not path.is_file():
        raise ConfigError(f"corpus '{d.corpus}' is neither 'synthetic', 'text' nor an existing .bin file")
    size = path.stat().st_size
    if size % 2:
        raise ConfigError(f"corpus file {path} has an odd number of bytes ({size}); a token corpus is uint16, two "
                          "bytes a token (text goes through a tokenizer first)")
    if size < 4:
        raise ConfigError(f"corpus file {path} has {size} bytes; expected at least two uint16 tokens")
    try:
        tokens = bin_corpus(path)
        return len(tokens), int(tokens.max()) + 1  # one pass over the file, at startup only
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read corpus file {path}: {e}") from None


def num_examples(cfg: RunConfig) -> int:
    """Training examples (windows of seq_len + 1 tokens) in the configured corpus."""
    return max(0, (_corpus_facts(cfg)[0] - 1) // cfg.model.seq_len)


def check_corpus(cfg: RunConfig) -> None:
    """Raise ConfigError unless the corpus exists, fits the vocabulary, and holds
    at least one global batch (batch_size * grad_accum * nproc examples)."""
    d, m, t = cfg.data, cfg.model, cfg.train
    n_tokens, needed_vocab = _corpus_facts(cfg)
    if m.vocab_size < needed_vocab:
        raise ConfigError(f"corpus '{d.corpus}' needs model.vocab_size >= {needed_vocab}, got {m.vocab_size}")
    examples = max(0, (n_tokens - 1) // m.seq_len)
    per_step = t.batch_size * t.grad_accum * cfg.dist.nproc
    if examples < per_step:
        raise ConfigError(f"corpus '{d.corpus}' holds {examples} examples of {m.seq_len} tokens but one step "
                          f"needs batch_size*grad_accum*nproc = {per_step}; use a bigger corpus or a smaller batch")


class ShardedLoader:
    """This rank's batches, in a deterministic order; its position is its state."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int,
                 rank: int, world_size: int, seed: int):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_examples = (len(tokens) - 1) // seq_len
        self.global_batch = batch_size * world_size
        self.batches_per_epoch = self.num_examples // self.global_batch
        if self.batches_per_epoch < 1:
            raise ValueError(f"{self.num_examples} examples cannot fill one global batch of {self.global_batch}")
        self.epoch, self.cursor = 0, 0  # cursor = micro-batches already taken this epoch
        self._order_epoch, self._order = -1, None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Example ids in the order epoch `epoch` visits them (all ranks agree)."""
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._order_epoch = epoch
        return self._order

    def rank_examples(self, epoch: int, batch: int) -> np.ndarray:
        """Example ids of this rank's share of micro-batch `batch` in `epoch`."""
        start = batch * self.global_batch
        window = self.epoch_order(epoch)[start:start + self.global_batch]
        return window[self.rank::self.world_size]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len) int64."""
        examples = self.rank_examples(self.epoch, self.cursor)
        self.cursor += 1
        if self.cursor == self.batches_per_epoch:
            self.epoch, self.cursor = self.epoch + 1, 0
        offsets = examples[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        window = torch.from_numpy(np.asarray(self.tokens[offsets], dtype=np.int64))
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "global_batch": self.global_batch, "num_examples": self.num_examples}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch", "num_examples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data loader state was saved with {key}={state[key]}, "
                                 f"this run has {getattr(self, key)}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
