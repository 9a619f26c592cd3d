"""Batches made ahead: a background thread prepares the next few while the step runs.

Reading a batch (gathering windows of a memory-mapped corpus, or a user's tokenizer on raw text) is host work
the accelerator waits for when it runs in the step. `Prefetcher` runs it in one thread, `depth` batches ahead,
through a bounded queue, so the step only takes a batch that is already made. The batches are the iterator's own,
in its order: prefetching changes when they are made, never which they are (a resumed run stays bit-identical).

A thread, not worker processes: the work that matters releases the GIL (numpy's gathers and page faults on a
memory-mapped file, a Rust tokenizer, torch's copies), and a thread shares the corpus's pages instead of
copying a process's worth of state. On a GPU the thread also copies each batch into pinned host memory, so the
step's copy to the device is asynchronous (`to_device`).

    with minitrain.Prefetcher(my_batches(), depth=2, device=device) as batches:
        for inputs, targets in batches:        # already on the device
            ...
"""
from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_END = object()  # the iterator is exhausted


class _Failed:
    """An exception the iterator raised: re-raised in the consumer at the batch it would have been."""

    def __init__(self, error: BaseException):
        self.error = error


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    """fn applied to every tensor of a batch: a tensor, or a tuple, list or dict of them (nested), the rest kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, b) for b in batch)
    if isinstance(batch, dict):
        return type(batch)((k, map_tensors(fn, v)) for k, v in batch.items())
    return batch


def pinned(batch: Any) -> Any:
    """The batch's CPU tensors in page-locked memory (a device copy from them does not block the host)."""
    return map_tensors(lambda t: t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory(), batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch on `device`. To a GPU from page-locked memory (pinned here unless the prefetch thread pinned it)
    without blocking the host: the copy is ordered on the current stream before any kernel that reads it."""
    if device.type != "cuda":
        return map_tensors(lambda t: t.to(device), batch)
    return map_tensors(lambda t: t.to(device, non_blocking=True), pinned(batch))


class Prefetcher:
    """The items of `batches`, each made by a background thread up to `depth` items before it is taken.

    device: when given, each batch is moved there as it is taken. pin_memory: the thread puts each batch in
    page-locked memory (default: when device is a GPU, so the copy there does not block). An exception in the iterator is raised at the item where it happened. close() (or leaving a `with`
    block) stops the thread; so does dropping the prefetcher (the thread holds the queue, not the prefetcher)."""

    def __init__(self, batches: Iterable, depth: int = 2, device: torch.device | str | None = None, *,
                 pin_memory: bool | None = None):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"Prefetcher needs depth >= 1 (batches made ahead), got {depth!r}")
        self.device = torch.device(device) if device is not None else None
        pin = (self.device is not None and self.device.type == "cuda") if pin_memory is None else pin_memory
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=_produce, args=(iter(batches), pin, self._queue, self._stop),
                                        daemon=True, name="minitrain-prefetch")
        self._thread.start()
        # Dropped unclosed: the thread ends too. Not at the interpreter's exit, where a woken daemon thread would be
        # stopped inside whatever it runs next; blocked on the full queue, it is left there.
        weakref.finalize(self, _shut, self._queue, self._stop).atexit = False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END or isinstance(item, _Failed):
            self._done = True
            self._thread.join()
            if item is _END:
                raise StopIteration
            raise item.error
        return item if self.device is None else to_device(item, self.device)

    def close(self) -> None:
        """Stop the thread and drop what it made ahead."""
        self._done = True
        _shut(self._queue, self._stop)
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def _produce(items: Iterator, pin: bool, out: queue.Queue, stop: threading.Event) -> None:
    """The thread: each item made (and pinned) into `out`, then the end or the iterator's exception."""
    try:
        for item in items:
            if not _put(out, pinned(item) if pin else item, stop):
                return
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
        _put(out, _Failed(e), stop)
        return
    _put(out, _END, stop)


def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
    """Queue an item, waiting for room; False once the consumer has stopped. (A put waiting when it stops
    finds the room _shut made and returns; the next one sees the stop.)"""
    if stop.is_set():
        return False
    out.put(item)
    return not stop.is_set()


def _shut(out: queue.Queue, stop: threading.Event) -> None:
    """Tell the thread to stop, and empty its queue so that a put waiting for room returns."""
    stop.set()
    with out.mutex:
        out.queue.clear()
        out.not_full.notify_all()
