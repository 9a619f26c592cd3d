"""One contiguous buffer for all parameters and one for all gradients.

Every model parameter becomes a view into `FlatParameters.data`, and its
`.grad` a view into `FlatParameters.grad` (autograd accumulates into an
existing .grad in place). A strategy then syncs gradients and updates
parameters with one collective over the whole buffer instead of one per
tensor. Both buffers are padded with zeros to a multiple of the world size so
N ranks get equal shards; the padding never receives a gradient.

`FlatStrategy` is what data parallel and ZeRO-1 share: the buffers, one
FlatAdamW over the slice of indices this rank updates, memory accounting, and
the state a checkpoint needs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..comm import Comm
from ..config import TrainConfig
from ..optim import FlatAdamW, clip_coefficient


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class FlatParameters:
    def __init__(self, model: nn.Module, world_size: int):
        named = list(model.named_parameters())  # tied weights appear once
        self.numel = sum(p.numel() for _, p in named)
        self.padded_numel = -(-self.numel // world_size) * world_size
        self.padding = self.padded_numel - self.numel
        dtype, device = named[0][1].dtype, named[0][1].device
        self.data = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        self.grad = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        self.segments: list[Segment] = []
        self._params: list[nn.Parameter] = []
        offset = 0
        with torch.no_grad():
            for name, p in named:
                n = p.numel()
                self.data[offset:offset + n].copy_(p.reshape(-1))
                p.data = self.data[offset:offset + n].view_as(p)
                p.grad = self.grad[offset:offset + n].view_as(p)
                self.segments.append(Segment(name, offset, tuple(p.shape)))
                self._params.append(p)
                offset += n

    def decay_ranges(self) -> list[tuple[int, int]]:
        """Flat ranges of matrices and embeddings (>= 2-D), the ones AdamW decays."""
        return [(s.offset, s.offset + s.numel) for s in self.segments if len(s.shape) >= 2]

    def check_grads_in_place(self) -> None:
        """Fail loudly if autograd replaced a .grad instead of accumulating into the buffer
        (e.g. someone called zero_grad(set_to_none=True)): the sync would miss it."""
        for seg, p in zip(self.segments, self._params):
            if p.grad is None or p.grad.data_ptr() != self.grad[seg.offset:].data_ptr():
                raise RuntimeError(f"gradient of '{seg.name}' is no longer a view of the flat gradient "
                                   "buffer; zero gradients with strategy.zero_grad(), not set_to_none")

    def named_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named, shaped views of a full flat vector (parameters or any same-layout tensor)."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.segments}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (unlike ==, tells -0.0 from 0.0 and matches NaNs)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Two state_snapshot()s (or any tensor dicts) equal byte for byte."""
    return a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, done in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], done))
        else:
            merged.append((start, done))
    return merged


def sync_summary(intervals: list[tuple[float, float]], backward_end: float | None) -> dict:
    """Gradient-sync figures of one step from each all-reduce's (launched, completed) times.

    allreduce_inflight_s: wall time during which any all-reduce was in flight (the union of
    the intervals: a backend runs queued async ops one after another, so their intervals
    overlap and a plain sum would count the queueing twice). overlap: the share of that
    time before backward ended, i.e. hidden behind compute (None when backward's end is not
    observable, as inside PyTorch DDP, whose wait happens within backward)."""
    merged = _union(intervals)
    inflight = sum(done - start for start, done in merged)
    hidden = None
    if backward_end is not None and inflight > 0:
        hidden = sum(max(0.0, min(done, backward_end) - start) for start, done in merged) / inflight
    return {"allreduce_calls": len(intervals), "allreduce_inflight_s": inflight, "overlap": hidden,
            "allreduce_ms": [round(1000 * (done - start), 3) for start, done in intervals]}


class FlatStrategy:
    """Shared machinery of data-parallel strategies over flat buffers.

    Subclasses set `name`, `shard_optimizer` and implement `step()`; they may
    override `no_sync()` and `finish_grad_sync()`. The trainer runs forward on
    `module` (the model, or a wrapper around it) and reads `last_sync` after
    each step.
    """

    name = "flat"
    shard_optimizer = False

    def __init__(self, model: nn.Module, comm: Comm, cfg: TrainConfig):
        self.model, self.comm, self.cfg = model, comm, cfg
        self.module: nn.Module = model
        self.last_sync: dict = {}
        self.flat = FlatParameters(model, comm.world_size)
        # Rank 0's initial parameters win, so replicas start identical whatever each rank's seed did.
        comm.broadcast(self.flat.data, src=0)
        if self.shard_optimizer:
            shard = self.flat.padded_numel // comm.world_size
            self.lo, self.hi = comm.rank * shard, (comm.rank + 1) * shard
        else:
            self.lo, self.hi = 0, self.flat.padded_numel
        self.optimizer = FlatAdamW(self.flat.data, self.lo, self.hi, self.flat.decay_ranges(), cfg)

    def zero_grad(self) -> None:
        self.flat.grad.zero_()

    def no_sync(self):
        """Context for all but the last micro-batch of a step: backward without gradient sync.
        Strategies that sync only inside step() need do nothing."""
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        """Complete this step's gradient sync (the trainer may call it early, to time it)."""

    def step(self, lr: float) -> float:
        """Sync gradients, clip, update parameters on every rank; return the global grad norm."""
        raise NotImplementedError

    def _clip_scale(self, sum_sq: torch.Tensor) -> tuple[float, float]:
        norm = float(sum_sq.sqrt())
        return norm, clip_coefficient(norm, self.cfg.grad_clip)

    # --- measurement ---------------------------------------------------------------
    def param_norm(self) -> float:
        return float(torch.linalg.vector_norm(self.flat.data, dtype=torch.float64))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held at rest, measured from the tensors' storages."""
        return {"params": self.flat.data.untyped_storage().nbytes(),
                "grads": self.flat.grad.untyped_storage().nbytes(),
                "optimizer": self.optimizer.nbytes()}

    def expected_memory_bytes(self) -> dict[str, int]:
        """The memory math: P = padded params, N = ranks, K = 3 optimizer tensors per param."""
        elem, P, N = self.flat.data.element_size(), self.flat.padded_numel, self.comm.world_size
        opt_params = P // N if self.shard_optimizer else P
        return {"params": elem * P, "grads": elem * P, "optimizer": 3 * elem * opt_params}

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of everything this rank holds that a resume must reproduce: the full
        parameters and this rank's optimizer state, keyed like the checkpoint."""
        state = {"params": self.flat.data.clone()}
        state.update({f"optim.{k}": v.clone() for k, v in self.optimizer.state_tensors().items()})
        return state

    # --- checkpoint state ----------------------------------------------------------
    def owned_range(self) -> tuple[int, int]:
        """Flat indices whose parameters and optimizer state this rank writes to a checkpoint.
        Replicated state is written once, by rank 0."""
        if self.shard_optimizer or self.comm.rank == 0:
            return self.lo, self.hi
        return 0, 0

    def state_shards(self) -> dict[str, torch.Tensor]:
        lo, hi = self.owned_range()
        if lo == hi:
            return {}
        shards = {"params": self.flat.data[lo:hi]}
        for name, t in self.optimizer.state_tensors().items():
            shards[f"optim.{name}"] = t[lo - self.lo:hi - self.lo]
        return shards

    @torch.no_grad()
    def load_state(self, full: dict[str, torch.Tensor], steps_taken: int) -> None:
        """Restore from full (unsharded, unpadded) flat vectors keyed like state_shards()."""
        n = self.flat.numel
        self.flat.data.zero_()
        self.flat.data[:n].copy_(full["params"][:n])
        for name, t in self.optimizer.state_tensors().items():
            src = full[f"optim.{name}"]
            t.zero_()
            hi = min(self.hi, n)
            if hi > self.lo:
                t[:hi - self.lo].copy_(src[self.lo:hi])
        self.optimizer.steps_taken = steps_taken
