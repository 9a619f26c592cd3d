"""Documents to token ids for `minitrain data prepare`, in this process (--workers 1) or in W worker processes.

Each worker loads the tokenizer from the tokenizer.json already written into the output, so every process encodes
with the very file the corpus ships, and runs `tokenizers` on one thread: W workers use W cores, no more. Documents
go out in batches and come back in the order they went, at most IN_FLIGHT_PER_WORKER batches a worker outstanding:
the input is read no faster than it is encoded, so memory stays bounded for input of any size (Pool.imap's feeder
thread would read the whole input ahead). Workers are spawned, not forked: `tokenizers`' thread pool (used by the
BPE training before) does not survive a fork. The results are the same bytes whatever the number of workers.
"""
from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from ..errors import ConfigError

# Small enough that W workers share the input evenly, large enough that sending a batch costs little beside
# encoding it; a batch ends at whichever limit comes first.
BATCH_DOCS, BATCH_CHARS = 256, 1 << 20
IN_FLIGHT_PER_WORKER = 2
ONE_THREAD = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class WorkerDied(ConfigError):
    """A worker ended before its work: like an interruption, what was written stays for --resume."""


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
    yield from _Workers(tokenizer_path, eot, dtype, workers).encode(batches(documents))


class _Workers:
    """W spawned processes taking (number, texts) from one queue, each answering (number, ids, lengths), or
    (number, None, error), on a pipe of its own. Not a ProcessPoolExecutor: its workers, which import torch with
    minitrain, go through the interpreter's slow teardown, and one that a kill of this process catches half way
    through reading a task waits for the rest of it forever. These leave with os._exit, and when this process is
    gone; and the pipe of a worker that dies reads as closed here, even half way through its answer."""

    def __init__(self, tokenizer_path: str, eot: int | None, dtype: np.dtype, workers: int):
        context = multiprocessing.get_context("spawn")
        self.tasks = context.Queue()
        self.limit = IN_FLIGHT_PER_WORKER * workers
        self.processes, self.answers = [], []
        for k in range(workers):
            answers, answer = context.Pipe(duplex=False)
            process = context.Process(target=_work, daemon=True, name=f"minitrain-encode-{k}",
                                      args=(tokenizer_path, eot, dtype.str, self.tasks, answer))
            process.start()
            answer.close()  # the worker's end: only the worker holds it, so its death closes the pipe
            self.processes.append(process)
            self.answers.append(answers)

    def encode(self, batches: Iterator[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        sent = taken = 0
        arrived: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        finished = False
        try:
            for texts in batches:
                self.tasks.put((sent, texts))
                sent += 1
                if sent - taken >= self.limit:
                    yield self._take(taken, arrived)
                    taken += 1
            while taken < sent:
                yield self._take(taken, arrived)
                taken += 1
            finished = True
        finally:
            self._stop(finished)

    def _take(self, number: int, arrived: dict) -> tuple[np.ndarray, np.ndarray]:
        """Batch `number`'s result (those that overtake it wait in `arrived`)."""
        while number not in arrived:
            for answers in multiprocessing.connection.wait(self.answers):
                try:
                    done, ids, lengths = answers.recv()
                except (EOFError, OSError):  # OSError: the pipe closed half way through an answer
                    raise WorkerDied("a tokenizing worker process died (killed, or out of memory)") from None
                if ids is None:
                    raise ConfigError(lengths)
                arrived[done] = ids, lengths
        return arrived.pop(number)

    def _stop(self, finished: bool) -> None:
        if finished:  # each worker leaves at its end-of-work mark
            for _ in self.processes:
                self.tasks.put(None)
        else:  # an error or Ctrl-C here: what the workers do is of no use any more
            self.tasks.cancel_join_thread()
            for process in self.processes:
                process.kill()  # not SIGTERM: a process started from one that ignores it would ignore it too
        for process in self.processes:
            process.join()
        for answers in self.answers:
            answers.close()
        self.tasks.close()


def _work(tokenizer_path: str, eot: int | None, dtype: str, tasks, answer) -> None:
    """A worker's life: encode batches until the end-of-work mark, or until the parent is gone."""
    threading.Thread(target=_leave_with_parent, daemon=True).start()
    os.environ.update(ONE_THREAD)  # before `tokenizers` starts its thread pool
    # Ctrl-C reaches the whole process group: the parent alone handles it, by stopping the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tok, dtype = load(tokenizer_path), np.dtype(dtype)
    while (task := tasks.get()) is not None:
        number, texts = task
        try:
            answer.send((number, *encode_texts(tok, texts, eot, dtype)))
        except ConfigError as e:
            answer.send((number, None, str(e)))
    answer.close()
    os._exit(0)


def _leave_with_parent() -> None:
    """A killed parent leaves its workers no one to work for: they end with it, wherever they are."""
    multiprocessing.parent_process().join()
    os._exit(1)
