"""Slices of whole parameters: what tensor and expert parallelism leave a rank of a parameter, where each slice
comes from, and how the whole is gathered back (for checkpoints and whole-model state)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ...runtime.comm import Comm


@dataclass(frozen=True)
class TensorSlice:
    """Where a tensor-parallel parameter comes from: entries `index` along `dim` of a whole parameter of
    shape `full_shape`."""

    full_shape: tuple[int, ...]
    dim: int
    index: torch.Tensor


def sharded_parameter(full: torch.Tensor, dim: int, index: torch.Tensor) -> tuple[nn.Parameter, TensorSlice]:
    """This rank's slice of a full parameter (the entries `index` along `dim`), and where it came from."""
    p = nn.Parameter(full.detach().index_select(dim, index.to(full.device)).clone(),
                     requires_grad=full.requires_grad)
    return p, TensorSlice(tuple(full.shape), dim, index.cpu())


def gather_slices(value: torch.Tensor, sl: TensorSlice, comm: Comm) -> torch.Tensor:
    """The whole tensor of which each rank of `comm` holds a slice like `sl` (its own entries along sl.dim):
    every rank's values and indices all-gathered, each put back where it came from. Collective over comm."""
    if comm.world_size == 1:
        return value
    pieces = value.new_empty((comm.world_size, *value.shape))
    comm.all_gather(pieces.view(-1), value.detach().contiguous().view(-1))
    index = sl.index.to(device=comm.device, dtype=torch.int64)
    indices = index.new_empty(comm.world_size * index.numel())
    comm.all_gather(indices, index)
    whole = value.new_empty(sl.full_shape)
    for piece, rows in zip(pieces, indices.view(comm.world_size, -1)):
        whole.index_copy_(sl.dim, rows.to(value.device), piece)
    return whole


def tensor_parallel_slices(model: nn.Module) -> dict[str, TensorSlice]:
    """{parameter name: its slice} for every sliced parameter of the layers below (tied weights under
    their canonical name, as named_parameters() gives it)."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    out = {}
    for module in model.modules():
        for pname, sl in getattr(module, "slices", {}).items():
            out[canonical[id(getattr(module, pname))]] = sl
    return out
