"""Gradient sync overlapped with backward: the flat gradient cut into buckets, each all-reduced as
soon as backward has produced its last gradient. Data parallel's default sync, and ZeRO-1's.

The flat gradient buffer is cut into buckets of at most `cap_bytes`, in reverse registration order
(the order backward produces gradients). A post-accumulate-grad hook on every parameter counts
arrivals; when a bucket's last gradient lands, its async all-reduce starts at once and runs while
backward computes the rest. Gradients are views into the buckets, so nothing is copied in or out.
Buckets launch strictly in bucket order, so every rank issues the same collectives in the same
order even if hooks fire slightly out of order (a mismatched order is the classic data-parallel hang).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ...runtime.comm import Comm, PendingCollective
from .flat_parameters import FlatParameters, Segment, missing_gradients
from .memory_math import MemoryLedger


@dataclass
class Bucket:
    """A contiguous range [start, stop) of the flat gradient buffer holding whole tensors."""

    start: int
    stop: int
    names: list[str] = field(default_factory=list)


def plan_buckets(segments: list[Segment], cap_bytes: int, element_size: int) -> list[Bucket]:
    """Group tensors in reverse registration order into buckets of at most cap_bytes
    (a tensor larger than the cap gets a bucket of its own)."""
    buckets: list[Bucket] = []
    for seg in reversed(segments):
        seg_bytes = seg.numel * element_size
        current = buckets[-1] if buckets else None
        if current is None or (current.stop - current.start) * element_size + seg_bytes > cap_bytes:
            buckets.append(Bucket(seg.offset, seg.offset + seg.numel, [seg.name]))
        else:  # segments are contiguous, so walking backwards extends the range downwards
            current.start = seg.offset
            current.names.append(seg.name)
    return buckets


class GradientToReduce:
    """What is summed across ranks: the flat gradient itself, or (mixed precision reducing in a wider
    dtype) its copy into a zeroed buffer of the reduce dtype the size of the model, held until the
    step ends."""

    def __init__(self, flat: FlatParameters, ledger: MemoryLedger, reduce_dtype: torch.dtype):
        self.flat, self.ledger, self.reduce_dtype = flat, ledger, reduce_dtype
        self._wide: torch.Tensor | None = None

    def range(self, start: int, stop: int) -> torch.Tensor:
        """The gradient range [start, stop) to sum: a view of flat.grad, or of its wide copy (filled now)."""
        grad = self.flat.grad
        if self.reduce_dtype == grad.dtype:
            return grad[start:stop]
        if self._wide is None:
            self._wide = torch.zeros(grad.numel(), dtype=self.reduce_dtype, device=grad.device)
            self.ledger.hold("grads", self._wide)
        return self._wide[start:stop].copy_(grad[start:stop])

    def tensor(self) -> torch.Tensor:
        """The whole gradient being summed (after the sync: the sum over ranks)."""
        return self.flat.grad if self._wide is None else self._wide

    def release(self) -> None:
        if self._wide is not None:
            self.ledger.drop("grads", self._wide)
            self._wide = None


class OverlappedAllReduce:
    """The bucketed, overlapped all-reduce of one flat gradient (see the module docstring)."""

    def __init__(self, flat: FlatParameters, comm: Comm, to_reduce: GradientToReduce, cap_bytes: int):
        self.flat, self.comm, self.to_reduce = flat, comm, to_reduce
        self.buckets = plan_buckets(flat.segments, cap_bytes, flat.grad.element_size())
        bucket_of = {name: i for i, b in enumerate(self.buckets) for name in b.names}
        self.handles = [flat.param_named(name).register_post_accumulate_grad_hook(
            lambda _p, name=name, i=bucket_of[name]: self._grad_ready(i, name)) for name in flat.names()]
        self.enabled = True  # False under no_sync(): backward accumulates locally
        self._reset()

    def _reset(self) -> None:
        self._arrived: list[set[str]] = [set() for _ in self.buckets]
        self._pending: list[PendingCollective] = []  # launched buckets, in bucket order

    def _grad_ready(self, i: int, name: str) -> None:
        if not self.enabled:
            return
        if i < len(self._pending):
            raise RuntimeError(f"gradient of '{name}' arrived after its bucket's all-reduce started: run all but "
                               "the last micro-batch of a step under no_sync (minitrain.no_sync(model) in a loop of "
                               "your own)")
        self._arrived[i].add(name)
        # Launch every bucket that is complete, strictly in order (same collective order on every rank).
        while len(self._pending) < len(self.buckets) and \
                len(self._arrived[len(self._pending)]) == len(self.buckets[len(self._pending)].names):
            b = self.buckets[len(self._pending)]
            self._pending.append(self.comm.all_reduce_sum_async(self.to_reduce.range(b.start, b.stop)))

    @contextlib.contextmanager
    def no_sync(self):
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def finish(self) -> list[tuple[float, float]]:
        """Wait for every bucket; returns their (launched, completed) times. The sum over ranks is then in
        to_reduce.tensor(). Raises, once what was launched is finished, if a parameter got no gradient."""
        if len(self._pending) < len(self.buckets):
            arrived = set().union(*self._arrived)
            missing = [s.name for s in self.flat.segments if s.name not in arrived]
            for pending in self._pending:  # finish what was launched: every rank launched the same
                pending.wait()
            self._reset()
            raise RuntimeError(missing_gradients(missing, self.flat, "an overlapped gradient sync"))
        intervals = [pending.wait() for pending in self._pending]
        self._reset()
        return intervals
