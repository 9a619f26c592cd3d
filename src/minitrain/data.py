"""Corpora, a byte-level tokenizer, and deterministic rank sharding.

A corpus is a 1-D array of token ids for training and, where the corpus has one, a held-out
split for validation (`load_val`): the synthetic corpus's is another walk of the same chain,
the shipped text's its last tenth, a prepared directory's its val.bin (`minitrain data
prepare`), a .bin file's a val.bin beside it.

Example i is the window
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
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .corpus import sharded, token_files
from .errors import ConfigError
from .utils.prefetch import Prefetcher

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


def make_corpus(seed: int, total_tokens: int, vocab_size: int = 64, walk: int = 0) -> np.ndarray:
    """Deterministic synthetic tokens with learnable structure.

    A sparse Markov chain: every token has three possible successors, taken
    with probability 0.7 / 0.2 / 0.1. A model that learns the table reaches a
    loss near the chain's entropy (about 0.8 nats) from ln(vocab) at init, so
    the loss visibly falls within a few steps. `walk` > 0 draws another walk of the same chain
    (the held-out split): same table, other tokens.
    """
    if total_tokens < 1 or vocab_size < 2:
        raise ValueError("need total_tokens >= 1 and vocab_size >= 2")
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, 3))
    if walk:
        rng = np.random.default_rng([seed, walk])
    choice = rng.choice(3, size=total_tokens, p=[0.7, 0.2, 0.1])
    tokens = np.empty(total_tokens, dtype=np.uint16)
    tok = int(rng.integers(0, vocab_size))
    for i in range(total_tokens):
        tokens[i] = tok
        tok = int(successors[tok, choice[i]])
    return tokens


# The DDP lab's dataset: windows of the synthetic corpus, each rank taking every world_size-th.
LAB_EXAMPLES, LAB_SEQ_LEN, LAB_VOCAB = 512, 32, 64


def make_shard(rank: int, world_size: int, num_examples: int = LAB_EXAMPLES, seq_len: int = LAB_SEQ_LEN,
               vocab_size: int = LAB_VOCAB, seed: int = 0) -> torch.Tensor:
    """This rank's examples (the DDP lab's sharding): example i, the window tokens[i*T : i*T + T + 1] of the
    synthetic corpus, goes to rank i % world_size. The ranks' shards do not overlap and together hold every
    example. Returns a (examples of this rank, T + 1) int64 tensor: inputs are [:, :-1], targets [:, 1:]."""
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"make_shard needs 0 <= rank < world_size, got rank {rank!r} of {world_size!r}")
    tokens = torch.from_numpy(make_corpus(seed, num_examples * seq_len + 1, vocab_size).astype(np.int64))
    windows = tokens.unfold(0, seq_len + 1, seq_len)[:num_examples]
    return windows[rank::world_size].clone()


# The shipped text's last tenth is held out for validation (as nanoGPT's prepare scripts split).
TEXT_VAL_FRACTION = 0.1


def _text_tokens() -> np.ndarray:
    text = resources.files("minitrain").joinpath("corpora", TEXT_CORPUS).read_text(encoding="utf-8")
    return ByteTokenizer().encode(text)


def _text_split() -> int:
    n = len(_text_tokens())
    return n - int(n * TEXT_VAL_FRACTION)


def text_corpus() -> np.ndarray:
    """The small prose corpus shipped with the package, byte-tokenized: its training part."""
    return _text_tokens()[:_text_split()]


def text_val_corpus() -> np.ndarray:
    """...and its held-out last tenth."""
    return _text_tokens()[_text_split():]


def bin_corpus(path: str | Path) -> np.ndarray:
    """A nanoGPT-style file of uint16 token ids, memory-mapped: pages load as batches touch them."""
    return np.memmap(path, dtype=np.uint16, mode="r")


def synthetic_val_tokens(cfg: RunConfig) -> int:
    """The synthetic corpus's held-out walk: a tenth of its length, at least one example."""
    return max(cfg.data.synthetic_tokens // 10, cfg.model.seq_len + 1)


def load_corpus(cfg: RunConfig) -> np.ndarray:
    """The training tokens."""
    d = cfg.data
    if d.corpus == "synthetic":
        return make_corpus(d.corpus_seed, d.synthetic_tokens, cfg.model.vocab_size)
    if d.corpus == "text":
        return text_corpus()
    if token_files.is_prepared_dir(d.corpus):
        return token_files.open_split(d.corpus, "train")
    return bin_corpus(d.corpus)


def load_val(cfg: RunConfig) -> np.ndarray | None:
    """The held-out tokens, or None for a corpus without a held-out split. A sharded corpus gives as many of
    its first corpus's val shards as --eval-batches reads."""
    d = cfg.data
    if sharded.is_sharded(d.corpus):
        return sharded.val_tokens(cfg, cfg.eval.batches * eval_examples_per_batch(cfg) * cfg.model.seq_len + 1)
    if d.corpus == "synthetic":
        return make_corpus(d.corpus_seed, synthetic_val_tokens(cfg), cfg.model.vocab_size, walk=1)
    if d.corpus == "text":
        return text_val_corpus()
    if token_files.is_prepared_dir(d.corpus):
        return token_files.open_split(d.corpus, "val")
    beside = Path(d.corpus).with_name("val.bin")
    return bin_corpus(beside) if beside.is_file() and beside != Path(d.corpus) else None


def corpus_vocab_size(corpus: str) -> int | None:
    """The vocabulary a tokenized corpus was made with (the model takes it unless told otherwise), or None."""
    if sharded.is_sharded(corpus):
        return sharded.load_index(corpus.split(",")[0].strip())[1].vocab_size
    if corpus == "text":
        return ByteTokenizer.vocab_size
    if token_files.is_prepared_dir(corpus):
        return int(token_files.read_meta(corpus)["vocab_size"])
    return None


def corpus_fingerprint(tokens: np.ndarray) -> str:
    """sha256 of the corpus's tokens as they are trained on: a resume must continue on the same data."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(tokens))).hexdigest()


def run_corpus_fingerprint(cfg: RunConfig) -> str:
    """The configured corpus's fingerprint, as its loader's fingerprint() gives it (a sharded corpus's from its
    indexes, without reading the shards)."""
    if sharded.is_sharded(cfg.data.corpus):
        return sharded.fingerprint(cfg)
    return corpus_fingerprint(load_corpus(cfg))


def make_loader(cfg: RunConfig, rank: int, world_size: int, prefetch: int = 0, pin_memory: bool = False):
    """The run's training batches for data-parallel rank `rank` of `world_size`: a TokenShards for a sharded
    corpus, else a ShardedLoader over the corpus's tokens (the same interface)."""
    if sharded.is_sharded(cfg.data.corpus):
        return sharded.loader(cfg, rank, world_size, prefetch, pin_memory)
    return ShardedLoader(load_corpus(cfg), cfg.model.seq_len, cfg.train.batch_size, rank, world_size,
                         cfg.train.seed, prefetch=prefetch, pin_memory=pin_memory)


# Files that hold text (or a table of it), not token ids: `data prepare` turns them into a corpus directory.
TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".csv", ".tsv", ".html", ".xml", ".parquet")


def _corpus_facts(cfg: RunConfig) -> tuple[int, int]:
    """(tokens in the training corpus, vocabulary it needs), or ConfigError if it cannot be read."""
    d = cfg.data
    if d.corpus == "synthetic":
        if d.synthetic_tokens < 2:
            raise ConfigError(f"data.synthetic_tokens must be at least 2, got {d.synthetic_tokens}")
        return d.synthetic_tokens, 2
    if d.corpus == "text":
        return len(text_corpus()), ByteTokenizer.vocab_size
    path = Path(d.corpus)
    if path.is_dir() and not token_files.is_prepared_dir(path):  # neither index.json (sharded.py) nor meta.json
        sharded.load_index(str(path))  # DataError, one line: not a corpus, or a prepare that did not finish
    if path.is_dir():
        meta = token_files.read_meta(path)  # ConfigError, one line, for a directory that is not a sound corpus
        token_files.check_ids(path)
        return int(meta["train_tokens"]), int(meta["vocab_size"])
    if not path.is_file():
        raise ConfigError(f"corpus '{d.corpus}' is neither 'synthetic', 'text', a directory from `minitrain data "
                          "prepare` nor an existing .bin file")
    if token_files.is_prepared_dir(path.parent) or sharded.is_sharded(str(path.parent)):
        beside = "index.json" if sharded.is_sharded(str(path.parent)) else token_files.META
        raise ConfigError(f"{path} belongs to a corpus directory ({path.parent / beside} beside it says how to read "
                          f"it): pass --corpus {path.parent}")
    if path.suffix.lower() in TEXT_SUFFIXES:
        raise ConfigError(f"corpus {path} is text, not token ids: tokenize it first with `minitrain data prepare "
                          f"{path} --vocab-size 4096 --out data/mine`, then pass --corpus data/mine")
    return _bin_facts(path)


def _bin_facts(path: Path) -> tuple[int, int]:
    size = path.stat().st_size
    if size % 2:
        raise ConfigError(f"corpus file {path} has an odd number of bytes ({size}); a token corpus is uint16, two "
                          "bytes a token (text goes through `minitrain data prepare` first)")
    if size < 4:
        raise ConfigError(f"corpus file {path} has {size} bytes; expected at least two uint16 tokens")
    try:
        tokens = bin_corpus(path)
        return len(tokens), int(tokens.max()) + 1  # one pass over the file, at startup only
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read corpus file {path}: {e}") from None


def num_examples(cfg: RunConfig) -> int:
    """Training examples (windows of seq_len + 1 tokens) in the configured corpus."""
    return _examples_and_vocab(cfg)[0]


def _examples_and_vocab(cfg: RunConfig) -> tuple[int, int]:
    """(training examples, the vocabulary the corpus needs); a sharded corpus's windows never cross shards."""
    if sharded.is_sharded(cfg.data.corpus):
        return sharded.facts(cfg)
    n_tokens, vocab = _corpus_facts(cfg)
    return max(0, (n_tokens - 1) // cfg.model.seq_len), vocab


def check_corpus(cfg: RunConfig) -> None:
    """Raise ConfigError unless the corpus exists, fits the vocabulary, and holds
    at least one global batch (batch_size * grad_accum * nproc examples)."""
    d, m, t = cfg.data, cfg.model, cfg.train
    examples, needed_vocab = _examples_and_vocab(cfg)
    if m.vocab_size < needed_vocab:
        raise ConfigError(f"corpus '{d.corpus}' needs model.vocab_size >= {needed_vocab}, got {m.vocab_size}")
    per_step = t.batch_size * t.grad_accum * cfg.dist.nproc
    if examples < per_step:
        raise ConfigError(f"corpus '{d.corpus}' holds {examples} examples of {m.seq_len} tokens but one step "
                          f"needs batch_size*grad_accum*nproc = {per_step}; use a bigger corpus or a smaller batch")


def eval_examples_per_batch(cfg: RunConfig) -> int:
    """Examples in one evaluation batch over every data-parallel rank (train.batch_size each)."""
    return cfg.train.batch_size * cfg.data_parallel_ranks


def check_eval_split(cfg: RunConfig) -> None:
    """Raise ConfigError unless the corpus has a held-out split holding at least one evaluation batch."""
    n_val = _val_length(cfg)
    if n_val is None:
        raise ConfigError(f"--eval-every needs a held-out split and corpus '{cfg.data.corpus}' has none; make one with "
                          "`minitrain data prepare TEXT... --out DIR` (or put a val.bin beside the .bin file)")
    examples, needed = (n_val - 1) // cfg.model.seq_len, eval_examples_per_batch(cfg)
    if examples < needed:
        raise ConfigError(f"the held-out split of corpus '{cfg.data.corpus}' holds {examples} examples of "
                          f"{cfg.model.seq_len} tokens, one evaluation batch needs batch_size x data-parallel ranks = "
                          f"{needed}; use more text, a larger val split or a smaller batch")


def eval_note(cfg: RunConfig) -> str | None:
    """A note when --eval-batches asks for more batches than the held-out split holds (the run evaluates on
    what there is)."""
    if not cfg.eval.every:
        return None
    held = ((_val_length(cfg) - 1) // cfg.model.seq_len) // eval_examples_per_batch(cfg)
    if held >= cfg.eval.batches:
        return None
    return (f"--eval-batches {cfg.eval.batches} asks for more than the held-out split of corpus '{cfg.data.corpus}' "
            f"holds ({held} batch(es) of {eval_examples_per_batch(cfg)} examples): evaluating on {held}")


def _val_length(cfg: RunConfig) -> int | None:
    """Tokens in the held-out split (None: the corpus has none), without fetching a store's shards."""
    if sharded.is_sharded(cfg.data.corpus):
        return sharded.val_token_count(cfg)
    val = load_val(cfg)
    return None if val is None else len(val)


class EvalBatches:
    """This rank's share of the held-out batches, the same ones at every evaluation: batch b is examples
    b*G .. (b+1)*G - 1 of the split in order (G = batch_size x data-parallel ranks), rank r takes every
    dp-th of them from r on. Every rank holds the same number of tokens, so the mean of the ranks' mean
    losses is the mean over all the batch's tokens."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, rank: int, world_size: int, batches: int):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world_size = rank, world_size
        global_batch = batch_size * world_size
        self.batches = min(batches, ((len(tokens) - 1) // seq_len) // global_batch)  # at least 1: config checked

    def __iter__(self):
        for b in range(self.batches):
            first = b * self.batch_size * self.world_size + self.rank
            examples = np.arange(first, first + self.batch_size * self.world_size, self.world_size)
            yield windows(self.tokens, examples, self.seq_len)


def windows(tokens: np.ndarray, examples: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the given examples, each (len(examples), seq_len) int64."""
    offsets = examples[:, None] * seq_len + np.arange(seq_len + 1)
    window = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))
    return window[:, :-1], window[:, 1:]


class ShardedLoader:
    """This rank's batches, in a deterministic order; its position is its state."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int,
                 rank: int, world_size: int, seed: int, prefetch: int = 0, pin_memory: bool = False):
        """prefetch: batches a background thread makes ahead (utils/prefetch.py; 0 = each made when taken);
        pin_memory: the prefetch thread makes them in page-locked memory (for a GPU's asynchronous copy)."""
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.prefetch, self.pin_memory = prefetch, pin_memory
        self._source: Iterator | None = None  # the batches from the current position on (a Prefetcher's thread)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_examples = (len(tokens) - 1) // seq_len
        self.global_batch = batch_size * world_size
        self.batches_per_epoch = self.num_examples // self.global_batch
        if self.batches_per_epoch < 1:
            raise ValueError(f"{self.num_examples} examples cannot fill one global batch of {self.global_batch}")
        self.epoch, self.cursor = 0, 0  # cursor = micro-batches already taken this epoch
        self._order_epoch, self._order = -1, None
        self._fingerprint: str | None = None

    def _shuffled(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Example ids in the order epoch `epoch` visits them (all ranks agree)."""
        if epoch != self._order_epoch:
            self._order, self._order_epoch = self._shuffled(epoch), epoch
        return self._order

    def _share(self, order: np.ndarray, batch: int) -> np.ndarray:
        start = batch * self.global_batch
        return order[start:start + self.global_batch][self.rank::self.world_size]

    def rank_examples(self, epoch: int, batch: int) -> np.ndarray:
        """Example ids of this rank's share of micro-batch `batch` in `epoch`."""
        return self._share(self.epoch_order(epoch), batch)

    def batches_from(self, epoch: int, cursor: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches from position (epoch, cursor) on, without end: what next_batch returns from there.
        Keeps its own order (nothing the loader changes), so a prefetch thread can run it."""
        order = self._shuffled(epoch)
        while True:
            yield windows(self.tokens, self._share(order, cursor), self.seq_len)
            cursor += 1
            if cursor == self.batches_per_epoch:
                epoch, cursor = epoch + 1, 0
                order = self._shuffled(epoch)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len) int64."""
        if self._source is None:
            batches = self.batches_from(self.epoch, self.cursor)
            self._source = (Prefetcher(batches, self.prefetch, pin_memory=self.pin_memory) if self.prefetch else
                            batches)
        batch = next(self._source)
        self.cursor += 1
        if self.cursor == self.batches_per_epoch:
            self.epoch, self.cursor = self.epoch + 1, 0
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (the next batch starts from the position again)."""
        if isinstance(self._source, Prefetcher):
            self._source.close()
        self._source = None

    def fingerprint(self) -> str:
        """sha256 of the tokens (computed once): a resume must continue on the same data."""
        if self._fingerprint is None:
            self._fingerprint = corpus_fingerprint(self.tokens)
        return self._fingerprint

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "global_batch": self.global_batch, "num_examples": self.num_examples}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch", "num_examples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data loader state was saved with {key}={state[key]}, "
                                 f"this run has {getattr(self, key)}")
        self.close()  # what was made ahead belongs to the old position
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
