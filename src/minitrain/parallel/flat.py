"""Contiguous buffers for all parameters (and gradients), cut into units that shard evenly.

Every model parameter becomes a view into `FlatParameters.data`, and (when a
full gradient buffer is kept) its `.grad` a view into `FlatParameters.grad`
(autograd accumulates into an existing .grad in place). A strategy then moves
whole units with one collective each instead of one per tensor.

A *unit* is a group of parameters that is reduced, gathered and sharded
together. Data parallel and ZeRO-1 use one unit, the whole model; ZeRO-2 and
ZeRO-3 use one unit per block (see units.py). Each unit is padded with zeros to
a multiple of the world size N, and rank r owns the r-th of its N equal chunks;
the padding never receives a gradient. A rank's *shard* is its chunks of every
unit, concatenated: the slice its optimizer updates.

Three coordinate systems, kept apart on purpose:
- physical: index into the padded flat buffer (Segment.offset, Unit.start);
- local: index into this rank's shard (the optimizer's vectors);
- logical: index into the unpadded concatenation of all parameters of the
  whole model in registration order (Segment.logical; a pipeline stage's
  parameters are a subset of it). Checkpoints store logical pieces, so they
  load at any world size, ZeRO stage or number of pipeline stages.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..comm import Comm
from ..config import TrainConfig
from ..optim import FlatAdamW, clip_coefficient, sum_of_squares
from ..precision import master_dtype, reduce_dtype


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int  # physical
    shape: tuple[int, ...]
    logical: int = 0  # where the whole parameter starts in the logical vector
    # A tensor-parallel slice: its shape in the whole model, and (local start, logical start, length) runs
    # saying where its elements lie in the logical vector. Empty for a whole parameter: one run.
    full_shape: tuple[int, ...] = ()
    slice_runs: tuple[tuple[int, int, int], ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        return self.slice_runs or ((0, self.logical, self.numel),)


def slice_runs(full_shape: tuple[int, ...], dim: int, index: torch.Tensor, logical: int) -> tuple:
    """(local start, logical start, length) runs of `full.index_select(dim, index)` flattened, for a
    parameter of `full_shape` (1-D or 2-D, sliced along dim 0 or 1) starting at `logical`: consecutive
    indices make one run, so a block of rows is one run and a block of columns one run per row."""
    groups, start = [], 0
    index = index.tolist()
    for i in range(1, len(index) + 1):
        if i == len(index) or index[i] != index[i - 1] + 1:
            groups.append((index[start], i - start))  # (first index, count)
            start = i
    row = 1 if len(full_shape) == 1 else full_shape[1]
    runs, at = [], 0
    if dim == 0:
        for first, count in groups:
            runs.append((at, logical + first * row, count * row))
            at += count * row
        return tuple(runs)
    for r in range(full_shape[0]):  # dim 1: this rank's columns of every row
        for first, count in groups:
            runs.append((at, logical + r * row + first, count))
            at += count
    return tuple(runs)


@dataclass(frozen=True)
class Unit:
    """Physical range [start, stop) of the flat buffer: its segments, then zero padding
    up to a multiple of the world size."""

    name: str
    start: int
    stop: int
    segments: tuple[Segment, ...]

    def chunk(self, rank: int, world_size: int) -> tuple[int, int]:
        """Physical range of rank's 1/N of this unit."""
        size = (self.stop - self.start) // world_size
        return self.start + rank * size, self.start + (rank + 1) * size


Ranges = list[tuple[int, int]]


def take(flat: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """A new tensor: the given physical ranges of `flat`, concatenated (physical -> local)."""
    return torch.cat([flat[a:b] for a, b in ranges]) if ranges else flat[:0].clone()


def local_views(local: torch.Tensor, ranges: Ranges) -> list[torch.Tensor]:
    """Views of a local (shard) vector, one per physical range it was taken from."""
    views, at = [], 0
    for a, b in ranges:
        views.append(local[at:at + b - a])
        at += b - a
    return views


def logical_layout(model: nn.Module) -> tuple[dict[str, int], int]:
    """({parameter name: its offset in the logical vector}, the vector's length) of a whole model:
    every parameter, unpadded, in registration order."""
    offsets, at = {}, 0
    for name, p in model.named_parameters():  # tied weights appear once
        offsets[name], at = at, at + p.numel()
    return offsets, at


class FlatParameters:
    def __init__(self, model: nn.Module, world_size: int, units: list[tuple[str, list[str]]] | None = None,
                 keep_grad: bool = True):
        named = dict(model.named_parameters())  # tied weights appear once
        self.numel = sum(p.numel() for p in named.values())  # what this rank holds
        # A pipeline stage holds part of the model, and says where that part lies in the whole one
        # (split_into_stage sets `logical_layout`), so that checkpoints from any stage share coordinates.
        logical, self.logical_numel = getattr(model, "logical_layout", None) or logical_layout(model)
        units = units or [("model", list(named))]
        listed = [n for _, names in units for n in names]
        if sorted(listed) != sorted(named):
            raise ValueError("units must list every parameter exactly once")
        self.units: list[Unit] = []
        offset = 0
        for unit_name, names in units:
            start, segs = offset, []
            for name in names:
                shape, sliced = tuple(named[name].shape), getattr(named[name], "full_slice", None)
                full_shape, runs = (sliced[0], slice_runs(*sliced, logical[name])) if sliced else ((), ())
                segs.append(Segment(name, offset, shape, logical[name], full_shape, runs))
                offset += named[name].numel()
            offset = start + padded_numel([offset - start], world_size)
            self.units.append(Unit(unit_name, start, offset, tuple(segs)))
        self.padded_numel = offset
        self.padding = self.padded_numel - self.numel
        # Segments in registration (= logical) order, whatever the unit order.
        self.segments = sorted((s for u in self.units for s in u.segments), key=lambda s: s.logical)
        p0 = next(iter(named.values()))
        self.dtype, self.device = p0.dtype, p0.device
        self.element_size = p0.element_size()
        self.data = torch.zeros(self.padded_numel, dtype=p0.dtype, device=p0.device)
        self.grad = torch.zeros_like(self.data) if keep_grad else None
        self._params = [named[s.name] for s in self.segments]
        self._by_name = named
        with torch.no_grad():
            for seg, p in zip(self.segments, self._params):
                self.data[seg.offset:seg.offset + seg.numel].copy_(p.reshape(-1))
                p.data = self.data[seg.offset:seg.offset + seg.numel].view_as(p)
                p.grad = None if self.grad is None else self.grad[seg.offset:seg.offset + seg.numel].view_as(p)

    def param(self, seg: Segment) -> nn.Parameter:
        return self._by_name[seg.name]

    def decay_ranges(self) -> Ranges:
        """Physical ranges of matrices and embeddings (>= 2-D), the ones AdamW decays."""
        return [(s.offset, s.offset + s.numel) for s in self.segments if len(s.shape) >= 2]

    def check_grads_in_place(self) -> None:
        """Fail loudly if autograd replaced a .grad instead of accumulating into the buffer
        (e.g. someone called zero_grad(set_to_none=True)): the sync would miss it."""
        for seg, p in zip(self.segments, self._params):
            if p.grad is None or p.grad.data_ptr() != self.grad[seg.offset:].data_ptr():
                raise RuntimeError(f"gradient of '{seg.name}' is no longer a view of the flat gradient "
                                   "buffer; zero gradients with strategy.zero_grad(), not set_to_none")

    # --- coordinates ----------------------------------------------------------------
    def to_logical(self, physical: torch.Tensor) -> torch.Tensor:
        """This rank's parameters, unpadded, in registration order (the whole logical vector unless the
        model is a pipeline stage)."""
        return torch.cat([physical[s.offset:s.offset + s.numel] for s in self.segments])

    def to_physical(self, logical: torch.Tensor) -> torch.Tensor:
        """The physical vector of this rank's parameters, read from the whole model's logical vector."""
        physical = logical.new_zeros(self.padded_numel)
        for s in self.segments:
            for at, lo, n in s.runs:
                physical[s.offset + at:s.offset + at + n] = logical[lo:lo + n]
        return physical

    def pieces(self, ranges: Ranges) -> list[list[int]]:
        """[at, lo, hi] for a local vector taken from `ranges`: its elements [at, at + hi - lo)
        hold logical [lo, hi). Padding maps to nothing."""
        out, at = [], 0
        for a, b in ranges:
            for s in self.segments:
                for local, logical, n in s.runs:
                    start = s.offset + local  # physical
                    lo, hi = max(a, start), min(b, start + n)
                    if lo < hi:
                        out.append([at + lo - a, logical + lo - start, logical + hi - start])
            at += b - a
        return sorted(out)

    def local_ranges(self, physical: Ranges, ranges: Ranges) -> Ranges:
        """The parts of physical ranges `physical` (e.g. decay ranges) inside `ranges`, in local coordinates."""
        out, at = [], 0
        for a, b in ranges:
            out += [(max(p, a) - a + at, min(q, b) - a + at) for p, q in physical if p < b and q > a]
            at += b - a
        return out


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
    """Gradient-sync figures of one step from each collective's (launched, completed) times.

    allreduce_inflight_s: wall time during which any gradient collective was in flight (the
    union of the intervals: a backend runs queued async ops one after another, so their
    intervals overlap and a plain sum would count the queueing twice). overlap: the share of
    that time before backward ended, i.e. hidden behind compute (None when backward's end is
    not observable, as inside PyTorch DDP, whose wait happens within backward)."""
    merged = _union(intervals)
    inflight = sum(done - start for start, done in merged)
    hidden = None
    if backward_end is not None and inflight > 0:
        hidden = sum(max(0.0, min(done, backward_end) - start) for start, done in merged) / inflight
    return {"allreduce_calls": len(intervals), "allreduce_inflight_s": inflight, "overlap": hidden,
            "allreduce_ms": [round(1000 * (done - start), 3) for start, done in intervals]}


MEMORY_KINDS = ("params", "grads", "optimizer")


def memory_terms(stage: int, master_is_params: bool) -> dict[str, tuple[int, bool]]:
    """The memory math, per kind: (tensors of P elements, sharded over N?). 3 optimizer tensors
    (master, m, v), 2 where the master is the parameter shard itself. Stage s shards the
    optimizer state (s >= 1), gradients (s >= 2), parameters (s = 3). The strategies and the
    planner both use this one rule."""
    return {"params": (1, stage >= 3), "grads": (1, stage >= 2),
            "optimizer": (2 if master_is_params else 3, stage >= 1)}


def padded_numel(unit_sizes: list[int], world_size: int) -> int:
    """Elements in the flat buffer: every unit padded to a multiple of the world size (as laid out below)."""
    return sum(-(-size // world_size) * world_size for size in unit_sizes)


class MemoryLedger:
    """Bytes of model state (params, grads, optimizer) a rank holds, now and at its peak.

    The at-rest figures come from the tensors themselves (`FlatStrategy.memory_bytes`);
    strategies report every transient model-state tensor they create and drop during a
    step (a gathered unit, a gradient bucket, a reduce-scatter output, a gradient autograd
    allocated) with `hold`/`drop`, so the peak is measured from tensor sizes too."""

    def __init__(self):
        self.transient = dict.fromkeys(MEMORY_KINDS, 0)
        self.peak_transient = dict.fromkeys(MEMORY_KINDS, 0)
        self.peak_total_transient = 0

    def hold(self, kind: str, t: torch.Tensor) -> None:
        self.transient[kind] += t.untyped_storage().nbytes()
        self.peak_transient[kind] = max(self.peak_transient[kind], self.transient[kind])
        self.peak_total_transient = max(self.peak_total_transient, sum(self.transient.values()))

    def drop(self, kind: str, t: torch.Tensor) -> None:
        self.transient[kind] -= t.untyped_storage().nbytes()

    def reset_peak(self) -> None:
        self.peak_transient = dict(self.transient)
        self.peak_total_transient = sum(self.transient.values())


class FlatStrategy:
    """Shared machinery of data-parallel strategies over flat buffers.

    `stage` says what is sharded across ranks, as in the ZeRO paper: 0 nothing,
    1 optimizer state, 2 also gradients, 3 also parameters. Subclasses set `name`
    and `stage` and implement `step()`; they may override `no_sync()` and
    `finish_grad_sync()`. The trainer runs forward on `module` (the model, or a
    wrapper around it) and reads `last_sync` after each step.
    """

    name = "flat"
    stage = 0
    master_is_params = False  # the optimizer's master vector is the parameters this rank holds (ZeRO-3, full precision)

    def __init__(self, model: nn.Module, comm: Comm, cfg: TrainConfig,
                 units: list[tuple[str, list[str]]] | None = None, keep_grad: bool = True):
        self.model, self.comm, self.cfg = model, comm, cfg
        self.module: nn.Module = model
        self.last_sync: dict = {}
        self.ledger = MemoryLedger()
        self.flat = FlatParameters(model, comm.world_size, units, keep_grad)
        # Rank 0's initial parameters win, so replicas start identical whatever each rank's seed did.
        comm.broadcast(self.flat.data, src=0)
        self.shard_ranges = self.ranges_of(comm.rank)
        decay = self.flat.local_ranges(self.flat.decay_ranges(), self.shard_ranges)
        # The master is in --dtype even when the parameters are 16-bit (mixed precision: precision.py).
        master = take(self.flat.data, self.shard_ranges).to(master_dtype(cfg))
        self.optimizer = FlatAdamW(master, decay, cfg)
        self.reduce_dtype = reduce_dtype(cfg)  # gradients are summed across ranks in this dtype
        self.tp = Comm()  # the tensor-parallel group, when the model is split (use_model_parallel)
        self.pp = Comm()  # the pipeline group, when this rank holds one stage of the model
        self._tp_sharded: Ranges = []  # physical ranges of parameters split across tp

    def use_model_parallel(self, tp: Comm, pp: Comm) -> None:
        """The model is split across other groups too: norms must cover the whole model. Parameters
        marked `tensor_parallel` are slices split across `tp` (their squares are summed over the group,
        replicated parameters counted once); each rank of `pp` holds different parameters (a stage),
        so the squares are summed over it."""
        self.tp, self.pp = tp, pp
        self._tp_sharded = [(s.offset, s.offset + s.numel) for s in self.flat.segments
                            if getattr(self.flat.param(s), "tensor_parallel", False)]

    def _sum_sq_parts(self, local: torch.Tensor, ranges: Ranges) -> torch.Tensor:
        """[squares of this rank's tensor-parallel slices, squares of everything else] of a local vector
        taken from `ranges`, in float64 (no tensor parallelism: [0, everything])."""
        if self.tp.world_size == 1:
            return torch.stack([torch.zeros((), dtype=torch.float64, device=local.device), sum_of_squares(local)])
        sharded = self.flat.local_ranges(self._tp_sharded, ranges)
        in_slices = sum((sum_of_squares(local[a:b]) for a, b in sharded),
                        torch.zeros((), dtype=torch.float64, device=local.device))
        rest, at = torch.zeros((), dtype=torch.float64, device=local.device), 0
        for a, b in [*sharded, (local.numel(), local.numel())]:
            rest = rest + sum_of_squares(local[at:a])
            at = b
        return torch.stack([in_slices, rest])

    def _total_sum_sq(self, parts: torch.Tensor) -> torch.Tensor:
        """The model's sum of squares from _sum_sq_parts (already summed over the data-parallel shards)."""
        total = parts[1]
        if self.tp.world_size > 1:
            in_slices = parts[:1].clone()
            self.tp.all_reduce_sum(in_slices)
            total = in_slices[0] + parts[1]
        if self.pp.world_size > 1:
            total = total.reshape(1).clone()
            self.pp.all_reduce_sum(total)
            total = total[0]
        return total

    def ranges_of(self, rank: int) -> Ranges:
        """Physical ranges whose optimizer state `rank` holds: everything, or its chunk of each unit."""
        if self.stage == 0:
            return [(0, self.flat.padded_numel)]
        return [u.chunk(rank, self.comm.world_size) for u in self.flat.units]

    def zero_grad(self) -> None:
        self.flat.grad.zero_()

    def no_sync(self):
        """Context for all but the last micro-batch of a step: backward without gradient sync.
        Strategies that sync only inside step() need do nothing."""
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        """Complete this step's gradient sync (the trainer may call it early, to time it)."""

    def step(self, lr: float, loss_scale: float = 1.0) -> float:
        """Sync gradients, clip, update parameters on every rank; return the global grad norm.
        The gradients are of loss * loss_scale (fp16 loss scaling); the norm returned and the
        update are of the unscaled loss. A non-finite norm (NaN/Inf in any rank's gradients, or an
        fp16 overflow) skips the update on every rank."""
        raise NotImplementedError

    def _clip_scale(self, sum_sq: torch.Tensor, loss_scale: float) -> tuple[float, float]:
        """(global norm of the unscaled gradient, the factor the optimizer multiplies the scaled
        gradient by: clipping and unscaling in one)."""
        norm = float(sum_sq.sqrt()) / loss_scale
        return norm, clip_coefficient(norm, self.cfg.grad_clip) / loss_scale

    # --- what this rank holds --------------------------------------------------------
    def held_params(self) -> torch.Tensor:
        """The parameter tensor this rank keeps between steps (full, or its shard at ZeRO-3)."""
        return self.flat.data

    def held_grads(self) -> torch.Tensor | None:
        """The gradient tensor this rank keeps between steps (None if only transient)."""
        return self.flat.grad

    def full_params(self) -> torch.Tensor:
        """Every parameter, unpadded, in registration order (collective at ZeRO-3)."""
        return self.flat.to_logical(self.flat.data)

    def param_norm(self) -> float:
        return float(self._total_sum_sq(self._sum_sq_parts(self.flat.data, [(0, self.flat.padded_numel)])).sqrt())

    # --- memory ------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes held at rest, measured from the tensors' storages."""
        params, grads = self.held_params().untyped_storage(), self.held_grads()
        state = [t.untyped_storage() for t in self.optimizer.state_tensors().values()]
        return {"params": params.nbytes(),
                "grads": 0 if grads is None else grads.untyped_storage().nbytes(),
                # A storage shared with the parameters is counted once, as parameters.
                "optimizer": sum(t.nbytes() for t in state if t.data_ptr() != params.data_ptr())}

    def peak_memory_bytes(self) -> dict[str, int]:
        """Most bytes of each kind held at any moment since the last reset_peak (at rest + transient)."""
        rest = self.memory_bytes()
        peak = {k: rest[k] + self.ledger.peak_transient[k] for k in MEMORY_KINDS}
        peak["total"] = sum(rest.values()) + self.ledger.peak_total_transient
        return peak

    def _memory_terms(self) -> dict[str, tuple[int, bool]]:
        return memory_terms(self.stage, self.master_is_params)

    def element_sizes(self) -> dict[str, int]:
        """Bytes per element of each kind: the parameters' dtype, the gradient tensor kept between
        steps (the reduce dtype at ZeRO-2/3), the optimizer's master dtype."""
        grads = self.held_grads()
        return {"params": self.flat.element_size,
                "grads": self.flat.element_size if grads is None else grads.element_size(),
                "optimizer": self.optimizer.master.element_size()}

    def expected_memory_bytes(self) -> dict[str, int]:
        """Bytes at rest by the memory math: P = padded params, N = ranks, E = bytes per element."""
        elem, P, N = self.element_sizes(), self.flat.padded_numel, self.comm.world_size
        return {kind: count * elem[kind] * (P // N if sharded else P)
                for kind, (count, sharded) in self._memory_terms().items()}

    def memory_formula(self) -> dict[str, str]:
        """expected_memory_bytes() as text in bytes per parameter, e.g. {"optimizer": "12*P/N", ...}
        (float32: 3 tensors of 4 bytes)."""
        elem = self.element_sizes()
        return {kind: f"{count * elem[kind]}*P" + ("/N" if sharded else "")
                for kind, (count, sharded) in self._memory_terms().items()}

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of everything this rank holds that a resume must reproduce: its parameters
        and its optimizer state, keyed like the checkpoint."""
        state = {"params": self.held_params().clone()}
        state.update({f"optim.{k}": v.clone() for k, v in self.optimizer.state_tensors().items()})
        return state

    # --- checkpoint state ----------------------------------------------------------
    def checkpoint_ranges(self, rank: int) -> Ranges:
        """Physical ranges whose parameters and optimizer state `rank` writes to a checkpoint.
        Replicated state is written once, by rank 0."""
        if self.stage >= 1 or rank == 0:
            return self.ranges_of(rank)
        return []

    def local_params(self) -> torch.Tensor:
        """This rank's parameters over its shard ranges (local layout, like the optimizer's)."""
        return take(self.flat.data, self.shard_ranges)

    def state_shards(self) -> dict[str, torch.Tensor]:
        if not self.checkpoint_ranges(self.comm.rank):
            return {}
        shards = {"params": self.local_params()}
        shards.update({f"optim.{k}": t for k, t in self.optimizer.state_tensors().items()})
        return shards

    def _load_params(self, physical: torch.Tensor) -> None:
        self.flat.data.copy_(physical)

    @torch.no_grad()
    def load_state(self, full: dict[str, torch.Tensor], steps_taken: int) -> None:
        """Restore from full logical vectors (unpadded, registration order) keyed like state_shards()."""
        self._load_params(self.flat.to_physical(full["params"]))
        for name, t in self.optimizer.state_tensors().items():
            t.copy_(take(self.flat.to_physical(full[f"optim.{name}"]), self.shard_ranges))
        self.optimizer.steps_taken = steps_taken
