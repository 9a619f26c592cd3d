"""Contiguous buffers for all trainable parameters (and gradients), cut into units that shard evenly.

Every trainable model parameter becomes a view into `FlatParameters.data`, and
(when a full gradient buffer is kept) its `.grad` a view into
`FlatParameters.grad` (autograd accumulates into an existing .grad in place).
A strategy then moves whole units with one collective each instead of one per
tensor. Frozen parameters (requires_grad=False) are left alone: no gradient
buffer, no optimizer state, never synced.

A *unit* is a group of parameters that is reduced, gathered and sharded
together. Data parallel and ZeRO-1 use one unit, the whole model; ZeRO-2 and
ZeRO-3 use one unit per block (see units.py). Each unit is padded with zeros to
a multiple of the world size N, and rank r owns the r-th of its N equal chunks;
the padding never receives a gradient. A rank's *shard* is its chunks of every
unit, concatenated: the slice its optimizer updates.

Three coordinate systems, kept apart on purpose:
- physical: index into the padded flat buffer (Segment.offset, Unit.start);
- local: index into this rank's shard (the optimizer's vectors);
- logical: index into the unpadded concatenation of all trainable parameters
  of the whole model in registration order (Segment.logical; a pipeline
  stage's parameters are a subset of it, a tensor-parallel slice a scatter of
  runs in it). Checkpoints store logical pieces, so they load at any world
  size, ZeRO stage or layout.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .memory_math import padded_numel
from ..state.placement import Placement, whole_state
from ..state.slices import TensorSlice


@dataclass
class WholeModel:
    """What a rank that holds part of a model (a pipeline stage, tensor-parallel slices) must know of the
    whole one to write checkpoints in its coordinates: every trainable parameter's offset in the logical
    vector, the vector's length, which of its own parameters are slices of a larger one, and the placement of
    every entry of the whole model's state_dict (its order, shapes and dtypes: placement.py). Computed from
    the full model before it is split (`WholeModel.of`), then passed to the strategy."""

    offsets: dict[str, int]
    numel: int
    slices: dict[str, TensorSlice] = field(default_factory=dict)
    state: dict[str, Placement] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> "WholeModel":
        offsets, numel = logical_layout(model)
        return cls(offsets, numel, state=whole_state(model))


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
    parameter of `full_shape` sliced along dim 0 (any number of dimensions: an entry is everything behind it,
    as an expert of a mixture's 3-D weights) or along dim 1 of a 2-D one, starting at `logical`: consecutive
    indices make one run, so a block of rows is one run and a block of columns one run per row."""
    groups, start = [], 0
    index = index.tolist()
    for i in range(1, len(index) + 1):
        if i == len(index) or index[i] != index[i - 1] + 1:
            groups.append((index[start], i - start))  # (first index, count)
            start = i
    row = math.prod(full_shape[1:]) if dim == 0 else full_shape[1]
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


def missing_gradients(missing: list[str], flat: FlatParameters, what: str) -> str:
    """The error for a step some parameters got no gradient in, naming the likely cause: frozen since prepare (it
    decided what it trains), none at all means the step came without a backward (or every backward ran under
    no_sync); some, parameters the loss never used."""
    frozen = [name for name in missing if not flat.param_named(name).requires_grad]
    if frozen:
        return (f"frozen (requires_grad_(False)) after prepare, which had taken them to train: {_first_few(frozen)}; "
                "freeze parameters before prepare (prepare the model again), as it decides what it syncs and updates")
    if len(missing) == len(flat.segments):
        return ("no parameter got a gradient this step: optimizer.step() came without a backward since the last "
                "step, or every backward ran under no_sync (the last micro-batch of a step runs outside it)")
    return (f"no gradient reached {_first_few(missing)} this step; {what} needs every parameter to take part in the "
            "loss (remove unused ones from the model, or freeze them with requires_grad_(False))")


def _first_few(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def logical_layout(model: nn.Module) -> tuple[dict[str, int], int]:
    """({parameter name: its offset in the logical vector}, the vector's length) of a whole model:
    every trainable parameter, unpadded, in registration order."""
    offsets, at = {}, 0
    for name, p in model.named_parameters():  # tied weights appear once
        if p.requires_grad:
            offsets[name], at = at, at + p.numel()
    return offsets, at


class FlatParameters:
    def __init__(self, model: nn.Module, world_size: int, units: list[tuple[str, list[str]]] | None = None,
                 keep_grad: bool = True, whole: WholeModel | None = None):
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}  # tied weights appear once
        if not named:
            raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
        self.numel = sum(p.numel() for p in named.values())  # what this rank holds
        # A pipeline stage or a tensor-parallel slice is part of a larger model, and says where it lies in the
        # whole one, so that checkpoints from any layout share coordinates.
        whole = whole or WholeModel.of(model)
        logical, self.logical_numel = whole.offsets, whole.numel
        units = units or [("model", list(named))]
        listed = [n for _, names in units for n in names]
        if sorted(listed) != sorted(named):
            raise ValueError("units must list every parameter exactly once")
        self.units: list[Unit] = []
        offset = 0
        for unit_name, names in units:
            start, segs = offset, []
            for name in names:
                shape, sliced = tuple(named[name].shape), whole.slices.get(name)
                full_shape, runs = ((sliced.full_shape, slice_runs(sliced.full_shape, sliced.dim, sliced.index,
                                                                   logical[name])) if sliced else ((), ()))
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
        self.sliced = set(whole.slices)  # names of tensor-parallel slices
        with torch.no_grad():
            for seg, p in zip(self.segments, self._params):
                self.data[seg.offset:seg.offset + seg.numel].copy_(p.reshape(-1))
                p.data = self.data[seg.offset:seg.offset + seg.numel].view_as(p)
                p.grad = None if self.grad is None else self.grad[seg.offset:seg.offset + seg.numel].view_as(p)

    def param(self, seg: Segment) -> nn.Parameter:
        return self._by_name[seg.name]

    def param_named(self, name: str) -> nn.Parameter:
        return self._by_name[name]

    def names(self) -> list[str]:
        return [s.name for s in self.segments]

    def ranges_of_names(self, names) -> Ranges:
        """Physical ranges of the named parameters."""
        names = set(names)
        return [(s.offset, s.offset + s.numel) for s in self.segments if s.name in names]

    def decay_ranges(self) -> Ranges:
        """Physical ranges of matrices and embeddings (>= 2-D), the ones AdamW decays."""
        return [(s.offset, s.offset + s.numel) for s in self.segments if len(s.shape) >= 2]

    def grads_in_place(self) -> None:
        """Before a sync reads the buffer: every p.grad is its view of it. One that is None got no gradient since
        the gradients were set to None, and its part of the buffer still holds an earlier step's: it is zeroed
        and viewed again, the zero a zero-filled buffer would have held (a bucketed sync refuses such a step
        anyway, naming the parameter). A tensor someone put in p.grad instead, which the sync would miss, is
        refused."""
        base, size = self.grad.data_ptr(), self.grad.element_size()  # once: this runs every step
        for seg, p in zip(self.segments, self._params):
            if not seg.numel:
                continue
            if p.grad is None:
                p.grad = self.grad[seg.offset:seg.offset + seg.numel].zero_().view(seg.shape)
            elif p.grad.data_ptr() != base + seg.offset * size:
                raise RuntimeError(f"the gradient of '{seg.name}' was replaced by a tensor of its own (p.grad = ...), "
                                   "so the gradient sync would miss it: change p.grad in place, or let backward "
                                   "make it")

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

    def pieces(self, ranges: Ranges, replicated: bool = True) -> list[list[int]]:
        """[at, lo, hi] for a local vector taken from `ranges`: its elements [at, at + hi - lo)
        hold logical [lo, hi). Padding maps to nothing. replicated=False: only tensor-parallel slices'
        elements (what a tensor-parallel rank but the first holds alone)."""
        out, at = [], 0
        segments = self.segments if replicated else [s for s in self.segments if s.name in self.sliced]
        for a, b in ranges:
            for s in segments:
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
