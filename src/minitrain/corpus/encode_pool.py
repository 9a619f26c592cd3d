"""Documents to token ids for `minitrain data prepare`, in this process (--workers 1) or in W worker processes.

Each worker loads the tokenizer from the tokenizer.json already written into the output, so every process encodes
with the very file the corpus ships, and runs `tokenizers` on one thread: W workers use W cores, no more. Documents
go out in batches and come back in the order they went, at most IN_FLIGHT_PER_WORKER batches a worker outstanding:
the input is read no faster than it is encoded, so memory stays bounded for input of any size (Pool.imap's feeder
thread would read the whole input ahead). Workers are spawned, not forked: `tokenizers`' thread pool (used by the
BPE training before) does not survive a fork.
"""
from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from ..errors import ConfigError

# Small enough that W workers share the input evenly, large enough that sending a batch costs little beside
# encoding it; a batch ends at whichever limit comes first.
BATCH_DOCS, BATCH_CHARS = 256, 1 << 20
IN_FLIGHT_PER_WORKER = 2
ONE_THREAD = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def batches(documents: Iterable[str]) -> Iterator[list[str]]:
    """`documents` in lists of at most BATCH_DOCS documents or about BATCH_CHARS characters."""
    batch, chars = [], 0
    for text in documents:
        batch.append(text)
        chars += len(text)
        if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_texts(tok, texts: list[str], eot: int | None, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(every document's ids followed by `eot`, laid end to end as `dtype`; each document's count of them).

    The ids of tokenizer.encode_batch, made without its list of ids per document: each document in
    bounded_pieces, encoded without character offsets (encode_batch_fast, where `tokenizers` has it: the same
    ids), laid end to end by numpy. `tok` as load() gives it."""
    from .tokenizer import bounded_pieces

    cut = [bounded_pieces(text) for text in texts]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    try:
        encodings = encode([piece for pieces in cut for piece in pieces], add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception, e.g. WordLevel without [UNK]
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"the tokenizer cannot encode the input: {reason}") from None
    pieces = iter([encoding.ids for encoding in encodings])
    documents = [list(itertools.islice(pieces, len(parts))) for parts in cut]
    end = () if eot is None else (eot,)
    lengths = np.fromiter((sum(map(len, ids)) + len(end) for ids in documents), dtype=np.int64, count=len(documents))
    flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(*ids, end) for ids in documents),
                       dtype=np.int64, count=int(lengths.sum()))
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
        raise ConfigError(f"the tokenizer gives id {int(flat.max())}, beyond what {dtype.name} holds")
    return flat.astype(dtype), lengths


def load(tokenizer_path: str):
    """The tokenizer, set to encode document text as plain text (tokenizer.py says why)."""
    from .tokenizer import _plain_text, load_tokenizer

    return _plain_text(load_tokenizer(tokenizer_path))


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def encoded(documents: Iterable[str], tokenizer_path: str, eot: int | None, dtype: np.dtype,
            workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """encode_texts() of each batch of `documents`, in order, by `workers` processes (1: this one)."""
    if workers == 1:
        tok = load(tokenizer_path)
        with _environment(ONE_THREAD):  # `tokenizers` reads it at each call: one thread here too
            for texts in batches(documents):
                yield encode_texts(tok, texts, eot, dtype)
        return
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                               initargs=(tokenizer_path, eot, dtype.str))
    pending: deque = deque()
    try:
        for texts in batches(documents):
            pending.append(pool.submit(_encode_in_worker, texts))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise ConfigError("a tokenizing worker process died (killed, or out of memory); add --resume to continue "
                          "from the last shard written") from None
    finally:
        pool.shutdown(wait=not pending, cancel_futures=True)


_WORKER: dict = {}


def _start_worker(tokenizer_path: str, eot: int | None, dtype: str) -> None:
    os.environ.update(ONE_THREAD)  # before `tokenizers` starts its thread pool
    # Ctrl-C reaches the whole process group: the parent alone handles it, by shutting the pool down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER.update(tok=load(tokenizer_path), eot=eot, dtype=np.dtype(dtype))


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_texts(_WORKER["tok"], texts, _WORKER["eot"], _WORKER["dtype"])
