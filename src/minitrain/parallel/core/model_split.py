"""What a data-parallel strategy must do because the model it holds is split across other groups too: tensor
parallel slices, pipeline stages, expert parallel's experts.

Norms must cover the whole model: the squares of tensor-parallel (or expert) slices are summed over their group,
replicated parameters counted once; each pipeline stage holds different parameters, so the squares are summed
over the pipeline group. Under expert parallelism the gradient averaged over the data-parallel replicas is also
settled over the experts' group (settle_experts).
"""
from __future__ import annotations

import torch

from ...runtime.comm import Comm
from .flat_parameters import FlatParameters, Ranges
from .norms import SquareSums


class ModelSplit:
    """The groups besides data parallel that `flat`'s model is split across (groups of one until use_groups)."""

    def __init__(self, flat: FlatParameters, device: torch.device):
        self.flat = flat
        self.tp = Comm(device=device)  # the group tensor-parallel (or expert) slices are split across
        self.pp = Comm(device=device)  # the pipeline group, when this rank holds one stage of the model
        self.sliced: Ranges = []  # physical ranges of parameters split across tp
        self.ep: Comm | None = None  # expert parallelism that splits the weights (settle_experts)
        self.settled = False  # this step's gradient settled over ep (settle_once; the strategy resets it per step)

    def use_groups(self, tp: Comm, pp: Comm) -> None:
        self.tp, self.pp = tp, pp
        self.sliced = self.flat.ranges_of_names(self.flat.sliced)

    def sum_sq_parts(self, local: torch.Tensor, ranges: Ranges) -> torch.Tensor:
        """[squares of this rank's tensor-parallel slices, squares of everything else] of a local vector
        taken from `ranges`, in float64 (no tensor parallelism: [0, everything])."""
        square_sums = SquareSums()  # its float64 buffer lives as long as this norm's computation
        if self.tp.world_size == 1:
            return torch.cat([torch.zeros(1, dtype=torch.float64, device=local.device), square_sums(local).reshape(1)])
        sharded = self.flat.local_ranges(self.sliced, ranges)
        in_slices = sum((square_sums(local[a:b]) for a, b in sharded),
                        torch.zeros((), dtype=torch.float64, device=local.device))
        rest, at = torch.zeros((), dtype=torch.float64, device=local.device), 0
        for a, b in [*sharded, (local.numel(), local.numel())]:
            rest = rest + square_sums(local[at:a])
            at = b
        return torch.stack([in_slices, rest])

    def total_sum_sq(self, parts: torch.Tensor) -> torch.Tensor:
        """The model's sum of squares from sum_sq_parts (already summed over the data-parallel shards)."""
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

    @torch.no_grad()
    def settle_once(self, local: torch.Tensor, ranges: Ranges) -> None:
        """settle_experts under expert parallelism, once per step: whichever reads the gradient first settles it."""
        if self.ep is not None and not self.settled:
            self.settle_experts(local, ranges)
            self.settled = True

    def settle_experts(self, local: torch.Tensor, ranges: Ranges) -> None:
        """The gradient averaged over the replicas (`local`, over `ranges`) becomes the average over every rank: the
        dense parameters' (each rank of an ep group saw other tokens) summed over the ep group, and everything
        divided by ep (an expert's already holds the tokens of its whole ep group, sent to it). Collective over ep."""
        experts = self.flat.local_ranges(self.sliced, ranges)
        dense, at = [], 0
        for a, b in [*experts, (local.numel(), local.numel())]:
            if a > at:
                dense.append((at, a))
            at = b
        if dense:
            summed = torch.cat([local[a:b] for a, b in dense]).to(self.ep.device)  # local may be host-held
            self.ep.all_reduce_sum(summed)
            for (a, b), part in zip(dense, summed.split([b - a for a, b in dense])):
                local[a:b] = part  # (item assignment: local may be a PieceVector, ZeRO-2/3's shard)
        local.div_(self.ep.world_size)
