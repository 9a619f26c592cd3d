"""State that data-parallel replicas cannot keep equal by themselves, for a model minitrain did not write.

Data parallelism is exact because every replica computes with the same parameters and buffers on its share
of the batch, and the gradients are averaged. Two things a model may do break that silently:

- A normalization layer in training mode that normalizes by the batch's own statistics (BatchNorm, and an
  InstanceNorm that tracks running statistics): each rank normalizes by its own share, so the outputs are
  not those of one process on the whole batch, and the running statistics drift apart rank by rank.
  `refuse_batch_statistics` makes such a layer raise when it runs in training mode over several replicas
  (torch.nn.SyncBatchNorm, which reduces the statistics over the ranks, and layers in eval mode pass).
- Any other buffer the model updates from its data (an average of activations, a counter of seen tokens).
  `check_buffers_agree` compares every buffer with the first replica's before a save or a full_state_dict,
  which would otherwise keep the first replica's values as if every rank had them.
"""
from __future__ import annotations

import torch
from torch import nn

from ...runtime.comm import Comm

BATCH_STATISTICS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
BROADCAST_BUCKET_BYTES = 64 << 20  # what start_alike copies at a time: the extra memory it holds at most


@torch.no_grad()
def start_alike(model: nn.Module, everyone: Comm) -> None:
    """Every parameter (trainable or frozen) and buffer of the whole model set to rank 0's, as DDP's constructor
    broadcasts them: the replicas, and the slices tensor, pipeline and expert parallelism then cut from the model,
    start as one model however each rank made it (nanoGPT seeds every rank differently before building it).
    Collective over `everyone`; tensors of one dtype travel together, a bucket at a time."""
    if everyone.world_size == 1:
        return
    tensors = [t.data for t in [*model.parameters(), *model.buffers()] if t.numel()]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t.view(torch.uint8) if t.dtype == torch.bool else t)
    for group in by_dtype.values():
        bucket, size = [], 0
        for t in [*group, None]:  # None: the end, which sends what is left
            if bucket and (t is None or size + t.numel() * t.element_size() > BROADCAST_BUCKET_BYTES):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                everyone.broadcast(flat, src=0)
                for b, part in zip(bucket, flat.split([b.numel() for b in bucket])):
                    b.copy_(part.view_as(b))
                bucket, size = [], 0
            if t is not None:
                bucket.append(t)
                size += t.numel() * t.element_size()


def refuse_batch_statistics(model: nn.Module, replicas: int) -> list:
    """Forward pre-hooks (their handles) that refuse a batch-statistics layer in training mode over `replicas`."""
    if replicas == 1:
        return []
    handles = []
    for name, module in model.named_modules():
        if not isinstance(module, BATCH_STATISTICS) or isinstance(module, nn.SyncBatchNorm):
            continue
        if isinstance(module, nn.modules.instancenorm._InstanceNorm) and not module.track_running_stats:
            continue  # each sample by itself: nothing crosses the batch

        def check(module, _args, name=name):
            if module.training:
                raise RuntimeError(
                    f"'{name}' ({type(module).__name__}) normalizes by the statistics of each rank's own batch in "
                    f"training mode, so over {replicas} data-parallel replicas it is not the model one process "
                    "trains, and its running statistics differ rank by rank: convert it with "
                    "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before prepare (CUDA), keep it in eval "
                    "mode (frozen statistics), or use LayerNorm / GroupNorm")

        handles.append(module.register_forward_pre_hook(check))
    return handles


def check_buffers_agree(model: nn.Module, dp: Comm, what: str) -> None:
    """Every persistent buffer equal to the first data-parallel replica's, bit for bit; else ValueError naming the
    first that differs (the same on every rank). Collective over dp."""
    if dp.world_size == 1:
        return
    buffers = [(key, b) for key, b in model.state_dict(keep_vars=True).items()
               if not isinstance(b, nn.Parameter) and b.numel()]
    if not buffers:
        return
    mine = torch.cat([b.detach().reshape(-1).to(torch.float64) for _, b in buffers])
    first = mine.clone()
    dp.broadcast(first, src=0)
    differs = ~((mine == first) | (mine.isnan() & first.isnan()))
    at = torch.tensor([int(differs.nonzero()[0]) if bool(differs.any()) else mine.numel()], device=mine.device)
    dp.all_reduce_min(at)
    if int(at) < mine.numel():
        ends = torch.tensor([b.numel() for _, b in buffers]).cumsum(0)
        key = buffers[int((ends <= int(at)).sum())][0]
        raise ValueError(f"{what}: buffer '{key}' differs across data-parallel ranks (the model updates it from each "
                         "rank's own data), so no one value is the model's: keep it equal on every rank (compute "
                         "it from reduced values), or make it a non-persistent buffer")


# --- every rank of one model replica must be fed alike --------------------------------------------------------
def feed_checksum(previous: torch.Tensor | None, values) -> torch.Tensor:
    """A checksum (int64, on the tensors' device) of every tensor in `values` (any nesting), folded into
    `previous`: their bits, weighted by position, so equal inputs give equal checksums on every rank and a
    different batch almost surely does not. No host synchronisation."""
    from ..core.units import tensors_in

    total = previous
    for t in tensors_in(values):
        flat = t.detach().reshape(-1)
        if flat.is_floating_point():
            flat = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()])
        flat = flat.to(torch.int64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device)
        value = (flat * weights).sum() + flat.numel()
        total = value if total is None else total * 1000003 + value  # int64 arithmetic wraps alike everywhere
    return total


def check_feeds(rows: list[int], replica_of: list[int], what: str) -> None:
    """rows: each rank's feed checksum; replica_of: each rank's data-parallel index. Ranks of one replica (its
    tensor-parallel and pipeline ranks) must have been fed alike; else ValueError naming them (the same on
    every rank, which all hold the same rows)."""
    by_replica: dict[int, dict[int, list[int]]] = {}
    for rank, (value, replica) in enumerate(zip(rows, replica_of)):
        by_replica.setdefault(replica, {}).setdefault(value, []).append(rank)
    for replica, groups in sorted(by_replica.items()):
        if len(groups) > 1:
            ranks = " vs ".join(str(sorted(g)) for g in sorted(groups.values()))
            raise ValueError(f"ranks {ranks} hold one model replica (dp_rank {replica}) but were fed different "
                             f"{what}: every tensor-, pipeline- or context-parallel rank of a replica must see the "
                             "same batch; "
                             "give each rank x.chunk(minitrain.dp_world_size())[minitrain.dp_rank()], not "
                             "x[rank::world_size]")
