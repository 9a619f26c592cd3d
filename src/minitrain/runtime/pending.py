"""A collective in flight: what an async op of comm.py returns. Its wait() finishes it, tells the collective watch
when this rank is in it, and books its time on the comm's clock from launch until the backend marked the work
complete (a callback on its future, or a CUDA event), not until someone waited for it: that is what tells how
much communication hid behind computation."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the type only: comm.py makes these and imports this module
    from .comm import Comm


class AllOf:
    """Several backend Works as one: a collective the comm layer runs as several ops."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([work.get_future() for work in self.works])


class PendingCollective:
    """An async collective in flight. `wait()` finishes it (on a GPU: orders the compute stream after it; the host
    does not block), books its stats and returns its (launched, completed) marks on the comm's clock (clock.py:
    host seconds, or CUDA events read after the step's host synchronisation)."""

    def __init__(self, comm: Comm, op: str, nbytes: int, work=None, payload: torch.Tensor | None = None,
                 fp: tuple | None = None, launched=None):
        self.comm, self.op, self.nbytes, self.work, self.fp = comm, op, nbytes, work, fp
        self.clock = comm.clock
        self.payload = payload  # a tensor the op reads or writes, kept alive until wait()
        self.launched = launched if launched is not None else self.clock.mark()  # marked before it was issued
        self.completed = None if work is not None else self.launched
        if work is not None and self.clock.on_device:
            self.completed = self.clock.mark_done(work)  # NCCL's future completes when queued: an event instead
        elif work is not None:
            try:
                work.get_future().add_done_callback(self._mark_completed)
            except RuntimeError:  # some gloo ops (reduce_scatter) have no future: completion = wait's return
                pass

    def _mark_completed(self, _future) -> None:
        self.completed = time.perf_counter()

    def wait(self) -> tuple:
        if self.work is not None:
            watch = self.comm.watch if self.fp is not None else None
            if watch is not None and not self.clock.on_device:
                watch.enter(self.fp)
            try:
                self.work.wait()
            except RuntimeError as e:
                raise self.comm.failure(self.op, self.nbytes, e, self.fp) from e
            finally:  # whatever ends the wait (an interrupt too), this rank is no longer in it
                if watch is not None and not self.clock.on_device:
                    watch.leave(self.fp)
            if watch is not None and self.clock.on_device:  # the host passed; the device is in it until it is done
                watch.outstanding(self.fp, self.work.is_completed)
            if self.completed is None:  # the callback may still be on its way; bound it by now
                self.completed = time.perf_counter()
            self.comm.record(self.op, self.nbytes, self.launched, self.completed)
            self.work = self.payload = None
        return self.launched, self.completed

    def done(self) -> bool:
        """True once the backend has finished it (no waiting); wait() still books it. On a GPU the device says
        (NCCL's future reports a collective done as soon as it is queued)."""
        if self.work is None:
            return True
        if self.clock.on_device:
            return self.work.is_completed()
        return self.completed is not None or self.work.is_completed()

    def then(self, fn) -> torch.futures.Future:
        """A torch Future that completes with fn() once this collective has (DDP hooks return one)."""
        if self.work is None:
            done = torch.futures.Future()
            done.set_result(fn())
            return done
        return self.work.get_future().then(lambda _future: fn())
