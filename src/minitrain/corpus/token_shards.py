"""TokenShards: this rank's batches from sharded corpora (local or in a store), the same global batches at any
world size, resumable mid-epoch without replaying anything.

The order is drawn from (seed, epoch) alone. Example w of a shard is its window tokens[w*T : w*T + T + 1];
windows never cross shards. Each epoch a corpus's shards are put in an order drawn from (seed, corpus, epoch)
and taken in blocks of `shuffle_block` shards; the examples of a block are shuffled among themselves (drawn from
(seed, corpus, epoch, block)). A full shuffle across a corpus larger than the cache would fetch a shard for
almost every example; block by block, the loader needs two blocks on disk (the one it reads, the next one
arriving) and reads a shard's bytes only where its windows lie.

A global batch is G = batch_size x world_size examples. With several corpora (a mixture), slot j of global batch
g takes the next example of corpus k, k drawn with the given weights from (seed, g); each corpus keeps its own
position and epochs. Rank r reads slots r, r + world_size, ...: together the ranks read the global batch, which
is the same for world 1 with batch 4N as for world N with batch 4. The state (global batches taken, and each
corpus's epoch and position) is a handful of integers: a resume goes straight there.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..utils.prefetch import Prefetcher
from .shard_cache import ShardCache
from .shard_index import INDEX, ShardIndex, parse_index
from .store import STORE_TIMEOUT_S, CorpusStore, DataError, read_text

SHUFFLE_BLOCK = 4  # shards shuffled together; the cache holds two blocks of each corpus
STATE_FORMAT = "token-shards/1"


def load_index(location: str, timeout_s: float = STORE_TIMEOUT_S) -> tuple[CorpusStore, ShardIndex]:
    """The corpus at `location` (a directory or a store URL) and its checked index; DataError if it has none."""
    store = CorpusStore(location, timeout_s)
    try:
        text = read_text(store, INDEX)
    except DataError as e:
        if "is missing" not in str(e):
            raise
        bucket = store.root.split("/")[0]
        if store.remote and not store.fs.exists(bucket):
            raise DataError(f"{location}: the bucket {bucket} does not exist (or these credentials do not see it); "
                            "check the name in --corpus") from None
        raise DataError(f"{location} holds no {INDEX}: not a corpus from `minitrain data prepare`, or one whose "
                        "prepare did not finish (run it again with --resume)") from None
    return store, parse_index(text, location)


def windows_in(shard, seq_len: int) -> int:
    """Examples (windows of seq_len + 1 tokens) in a shard: windows never cross shards."""
    return max(0, (shard.tokens - 1) // seq_len)


class CorpusOrder:
    """One corpus's examples in the order epoch e visits them: position p of epoch e -> (shard, window)."""

    def __init__(self, index: ShardIndex, split: str, seq_len: int, seed: int, corpus: int, shuffle_block: int):
        self.shards = [s for s in index.split(split) if s.tokens > seq_len]  # shards holding one window at least
        self.windows = np.array([windows_in(s, seq_len) for s in self.shards], dtype=np.int64)
        self.num_examples = int(self.windows.sum())
        self.seed, self.corpus, self.block = seed, corpus, shuffle_block
        self._blocks: dict[int, tuple] = {}  # the last epochs' blocks, and the last blocks' orders (two of each:
        self._orders: dict[tuple[int, int], tuple] = {}  # the reader's and the one the fetch asks about)

    def blocks(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(each block's shard numbers, the examples before each block) for `epoch`."""
        if epoch not in self._blocks:
            self._blocks = {**dict(list(self._blocks.items())[-1:]), epoch: self._make_blocks(epoch)}
        return self._blocks[epoch]

    def _make_blocks(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        order = np.random.default_rng([self.seed, self.corpus, epoch]).permutation(len(self.shards))
        blocks = [order[i:i + self.block] for i in range(0, len(order), self.block)]
        sizes = np.array([self.windows[b].sum() for b in blocks], dtype=np.int64)
        return blocks, np.concatenate([[0], np.cumsum(sizes)])

    def _block_order(self, epoch: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, window) of each position inside a block, shuffled."""
        if (epoch, block) not in self._orders:
            self._orders = {**dict(list(self._orders.items())[-1:]), (epoch, block): self._shuffle(epoch, block)}
        return self._orders[(epoch, block)]

    def _shuffle(self, epoch: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        shards = self.blocks(epoch)[0][block]
        shard_of = np.repeat(shards, self.windows[shards])
        window = np.concatenate([np.arange(self.windows[s]) for s in shards])
        perm = np.random.default_rng([self.seed, self.corpus, epoch, block]).permutation(len(shard_of))
        return shard_of[perm], window[perm]

    def example(self, epoch: int, position: int) -> tuple[int, int, int]:
        """(block, shard number, window) at `position` of `epoch`."""
        starts = self.blocks(epoch)[1]
        block = int(np.searchsorted(starts, position, side="right")) - 1
        shard_of, window = self._block_order(epoch, block)
        return block, int(shard_of[position - starts[block]]), int(window[position - starts[block]])


class TokenShards:
    """An endless iterable of this rank's (inputs, targets) batches, each (batch_size, seq_len) int64, from one
    sharded corpus or a weighted mixture of several. `state_dict()` / `load_state_dict()` carry the position.

        loader = minitrain.TokenShards("s3://bucket/corpus", seq_len=1024, batch_size=8,
                                       rank=minitrain.dp_rank(), world_size=minitrain.dp_world_size())
        for step, (x, y) in zip(range(steps), loader):
            ...

    cache_dir / cache_mb: where a store's shards are kept on this machine, and how much of them (default: two
    shuffle blocks of each corpus); prefetch: batches made ahead by a background thread, while another fetches the
    next block's shards."""

    def __init__(self, corpus: str | list[str], seq_len: int, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, weights: list[float] | None = None, split: str = "train",
                 cache_dir: str | Path | None = None, cache_mb: float | None = None, prefetch: int = 2,
                 shuffle_block: int = SHUFFLE_BLOCK, store_timeout_s: float = STORE_TIMEOUT_S,
                 pin_memory: bool = False):
        locations = [corpus] if isinstance(corpus, str) else list(corpus)
        self.weights = check_weights(weights, len(locations))
        if not (0 <= rank < world_size and batch_size >= 1 and seq_len >= 1 and shuffle_block >= 1):
            raise ValueError(f"TokenShards needs 0 <= rank < world_size, batch_size, seq_len and shuffle_block >= 1; "
                             f"got rank {rank} of {world_size}, batch_size {batch_size}, seq_len {seq_len}")
        self.seq_len, self.batch_size, self.rank, self.world_size, self.seed = seq_len, batch_size, rank, world_size, seed
        self.global_batch, self.prefetch, self.pin_memory = batch_size * world_size, prefetch, pin_memory
        loaded = [load_index(loc, store_timeout_s) for loc in locations]
        self.indexes = [index for _, index in loaded]
        self.orders = [CorpusOrder(index, split, seq_len, seed, k, shuffle_block) for k, index in enumerate(self.indexes)]
        for loc, order in zip(locations, self.orders):
            if order.num_examples == 0:
                raise DataError(f"{loc} holds no {split} example of {seq_len + 1} tokens in any shard")
        check_one_tokenizer(locations, loaded)
        remote = [index for store, index in loaded if store.remote]
        budget = default_cache_bytes(remote, shuffle_block) if not cache_mb else int(cache_mb * 2**20)
        check_cache_budget(budget, remote, shuffle_block)
        root = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "minitrain" / "shards"
        self.caches = [ShardCache(store, index, root / _key(loc), budget // max(len(remote), 1))
                       for loc, (store, index) in zip(locations, loaded)]
        self.num_examples = sum(o.num_examples for o in self.orders)
        self.batch, self.positions = 0, [(0, 0)] * len(self.orders)  # global batches taken; each corpus's (epoch, p)
        self._source: Iterator | None = None
        self._fetcher: BlockFetcher | None = None

    # ---- the order -----------------------------------------------------------------------------------------

    def _corpus_of_slots(self, batch: int) -> np.ndarray:
        if len(self.orders) == 1:
            return np.zeros(self.global_batch, dtype=np.int64)
        return np.random.default_rng([self.seed, batch]).choice(len(self.orders), self.global_batch, p=self.weights)

    def _advance(self, batch: int, positions: list[tuple[int, int]]):
        """The slots of global batch `batch` from `positions`: [(corpus, epoch, position)] and the positions
        after it."""
        positions, slots = list(positions), []
        for k in self._corpus_of_slots(batch):
            epoch, p = positions[k]
            slots.append((int(k), epoch, p))
            p += 1
            positions[k] = (epoch + 1, 0) if p == self.orders[k].num_examples else (epoch, p)
        return slots, positions

    def batches_from(self, batch: int, positions: list[tuple[int, int]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches from that position on, without end (what a prefetch thread runs)."""
        current: dict[int, tuple[int, int]] = {}  # each corpus's block being read
        opened: dict[tuple[int, int], np.memmap] = {}  # its shards, mapped once
        while True:
            slots, positions = self._advance(batch, positions)
            rows = []
            for k, epoch, p in slots[self.rank::self.world_size]:
                block, shard, window = self.orders[k].example(epoch, p)
                if current.get(k) != (epoch, block):  # entering a block: ask for the next one's shards
                    current[k] = (epoch, block)
                    opened = {key: m for key, m in opened.items() if key[0] != k}
                    self._announce(k, epoch, block)
                if (k, shard) not in opened:
                    opened[(k, shard)] = self.caches[k].open(self.orders[k].shards[shard])
                tokens = opened[(k, shard)]
                start = window * self.seq_len
                rows.append(np.asarray(tokens[start:start + self.seq_len + 1], dtype=np.int64))
            batch += 1
            window = torch.from_numpy(np.stack(rows))
            yield window[:, :-1].contiguous(), window[:, 1:].contiguous()  # a model may .view() them

    def _announce(self, k: int, epoch: int, block: int) -> None:
        """The shards of this block are in use, and the next block's are fetched in the background."""
        order, cache = self.orders[k], self.caches[k]
        blocks = order.blocks(epoch)[0]
        nxt = (epoch, block + 1) if block + 1 < len(blocks) else (epoch + 1, 0)
        upcoming = order.blocks(nxt[0])[0][nxt[1]]
        cache.keep = {order.shards[s].name for s in (*blocks[block], *upcoming)}
        if self._fetcher is not None:
            self._fetcher.ask(cache, [order.shards[s] for s in upcoming])

    # ---- the loader's interface ----------------------------------------------------------------------------

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._source is None:
            self._fetcher = BlockFetcher()
            batches = self.batches_from(self.batch, self.positions)
            self._source = (Prefetcher(batches, self.prefetch, pin_memory=self.pin_memory) if self.prefetch
                            else batches)
        batch = next(self._source)
        self.positions = self._advance(self.batch, self.positions)[1]
        self.batch += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def close(self) -> None:
        if isinstance(self._source, Prefetcher):
            self._source.close()
        if self._fetcher is not None:
            self._fetcher.close()
        self._source = self._fetcher = None

    @property
    def vocab_size(self) -> int:
        """The vocabulary the corpora's ids come from (index.json's): the model's embedding needs at least it."""
        return self.indexes[0].vocab_size

    def fingerprint(self) -> str:
        return mixture_fingerprint(self.indexes, self.weights.tolist())

    def cached_bytes(self) -> int:
        return sum(c.cached_bytes() for c in self.caches)

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "batch": self.batch, "positions": [list(p) for p in self.positions],
                "seed": self.seed, "global_batch": self.global_batch, "num_examples": self.num_examples,
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError("this loader state is not a TokenShards state (saved by another loader)")
        for key in ("seed", "global_batch", "num_examples", "fingerprint"):
            if state[key] != (self.fingerprint() if key == "fingerprint" else getattr(self, key)):
                raise ValueError(f"data loader state was saved with another {key.replace('_', ' ')}; resume with "
                                 "the same corpora, weights, seed and global batch")
        self.close()  # what was made ahead belongs to the old position
        self.batch, self.positions = int(state["batch"]), [tuple(map(int, p)) for p in state["positions"]]


class BlockFetcher:
    """A background thread that brings the next block's shards to disk while the current block is read."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="minitrain-shard-fetch")
        self._thread.start()

    def ask(self, cache: ShardCache, shards: list) -> None:
        for shard in shards:
            self._queue.put((cache, shard))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            cache, shard = item
            # A failure here is met again by the reader when it needs the shard, and said there.
            with contextlib.suppress(Exception):
                cache.ensure(shard)

    def close(self) -> None:
        self._queue.put(None)


def check_one_tokenizer(locations: list[str], loaded: list) -> None:
    """A mixture's corpora were made with one tokenizer (the same tokenizer.json bytes): ids of two tokenizers
    mean different text however alike their vocabulary sizes."""
    if len(loaded) < 2:
        return
    digests = [hashlib.sha256(store.read(index.meta["tokenizer"])).hexdigest() for store, index in loaded]
    if len(set(digests)) > 1:
        other = next(loc for loc, d in zip(locations, digests) if d != digests[0])
        raise DataError(f"{other} was prepared with another tokenizer than {locations[0]} (their tokenizer.json "
                        "differ): prepare every corpus of a mixture with one --tokenizer")


def mixture_fingerprint(indexes: list[ShardIndex], weights: list[float] | None) -> str:
    """sha256 over the corpora's shard listings and their weights: a resume continues on the same data."""
    w = check_weights(weights, len(indexes)).tolist()
    return hashlib.sha256(json.dumps([[i.fingerprint() for i in indexes], w]).encode()).hexdigest()


def check_weights(weights, n: int) -> np.ndarray:
    if weights is None:
        if n > 1:
            raise ValueError(f"{n} corpora need weights (one per corpus, e.g. --data.weights 0.7,0.3)")
        return np.ones(1)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights must be {n} positive numbers, one per corpus; got {list(weights)}")
    return w / w.sum()


def _block_bytes(index: ShardIndex, shuffle_block: int) -> int:
    largest = max(s.nbytes(index.dtype) for s in index.shards)
    return largest * min(shuffle_block, len(index.shards))


def default_cache_bytes(indexes: list[ShardIndex], shuffle_block: int) -> int:
    """Two blocks of each corpus (the one being read and the next) and a shard of room."""
    return sum(2 * _block_bytes(i, shuffle_block) + max(s.nbytes(i.dtype) for s in i.shards) for i in indexes)


def check_cache_budget(budget: int, indexes: list[ShardIndex], shuffle_block: int) -> None:
    need = sum(_block_bytes(i, shuffle_block) for i in indexes)
    if budget < need:
        raise DataError(f"--data.cache_mb {budget / 2**20:g} cannot hold the shards read at once ({shuffle_block} of "
                        f"each corpus: {need / 2**20:.1f} MB); give at least {need / 2**20:.1f}, twice that to fetch "
                        "the next ones while reading")


def _key(location: str) -> str:
    """A cache subdirectory per corpus: two corpora's shards share names."""
    return hashlib.sha256(location.rstrip("/").encode()).hexdigest()[:16]
