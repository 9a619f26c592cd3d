"""Expert parallelism (`--dist.ep N`): each rank of a group of N computes 1/N of every mixture-of-experts layer's
experts, and tokens travel to them and back by all-to-all.

The data-parallel ranks are cut into groups of N consecutive ranks; within a group, rank g computes experts
[g*E/N, (g+1)*E/N) of every layer. A layer's forward on one rank (models/minigpt/moe.py routes, this moves):
1. its routed rows, grouped by expert, are grouped by the rank that computes them too (experts are numbered
   in rank order); every rank tells every other how many rows it sends for each of its experts (an all-to-all
   of E counts);
2. the rows go out in one all-to-all of uneven sizes (`Comm.all_to_all_uneven`: counted, timed and watched as
   every collective); what arrives is regrouped by local expert, each local expert computes all its rows, from
   every rank, in one batch (an expert that got none runs on none);
3. the outputs go back by the reverse all-to-all into the sender's row order, and the sender combines them as
   without expert parallelism.
Backward runs the same exchanges the other way (the all-to-all's gradient is the reverse all-to-all).

What changes is where each expert's arithmetic happens, not what it is: the routing, capacity drops and
combination are each rank's own, as at ep = 1, so the run equals data parallelism over the same ranks (to
float rounding: an expert's matrix multiplies see its rows from every rank at once). The experts' weights are
still held whole by every rank and their gradients averaged over the whole data-parallel group (the ranks that
do not compute an expert contribute zeros to its gradient, so the sum is the gradient of the whole batch); ZeRO
shards them as every parameter. Holding only a rank's own experts, reduced over their replicas, is the next step
(docs/moe.md).
"""
from __future__ import annotations

import torch

from ..runtime.comm import Comm


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by in_splits, from ranks by out_splits; backward: the gradient the reverse way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        comm.all_to_all_uneven(out, rows.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all_uneven(back, grad.contiguous(), ctx.in_splits, ctx.out_splits)
        return back, None, None, None


class ExpertParallel:
    """A layer's run_experts when its experts are spread over `comm` (one expert-parallel group)."""

    def __init__(self, layer, comm: Comm):
        if layer.experts % comm.world_size:
            raise ValueError(f"{layer.experts} experts cannot be split evenly over {comm.world_size} ranks")
        self.layer, self.comm = layer, comm
        self.per_rank = layer.experts // comm.world_size
        self.local = range(comm.rank * self.per_rank, (comm.rank + 1) * self.per_rank)

    def __call__(self, inputs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ranks, per = self.comm.world_size, self.per_rank
        send = torch.tensor(counts, dtype=torch.int64, device=self.comm.device)
        arriving = torch.empty_like(send)
        self.comm.all_to_all(arriving, send)  # arriving[i * per + j]: rows rank i sends for local expert j
        send_counts, arriving_counts = send.view(ranks, per), arriving.view(ranks, per)
        in_splits, out_splits = send_counts.sum(1).tolist(), arriving_counts.sum(1).tolist()
        received = _AllToAll.apply(inputs, self.comm, out_splits, in_splits)  # by source rank, then local expert
        by_expert = self._expert_major(arriving_counts)
        outputs = self.layer.expert_outputs(received[by_expert], arriving_counts.sum(0).tolist(), self.local)
        back = torch.empty_like(outputs).index_copy(0, by_expert, outputs)  # the arrival order again
        return _AllToAll.apply(back, self.comm, in_splits, out_splits)

    @staticmethod
    def _expert_major(counts: torch.Tensor) -> torch.Tensor:
        """The row permutation from (source rank, local expert) order to (local expert, source rank) order."""
        starts = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view_as(counts)
        pieces = [torch.arange(int(starts[i, j]), int(starts[i, j] + counts[i, j]), device=counts.device)
                  for j in range(counts.size(1)) for i in range(counts.size(0))]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=counts.device)


def apply_expert_parallel(model: torch.nn.Module, comm: Comm, layer_type: type) -> int:
    """Spread the experts of every `layer_type` module of `model` over `comm`; returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, layer_type)]
    if comm.world_size > 1:
        for layer in layers:
            layer.run_experts = ExpertParallel(layer, comm)
    return len(layers)
