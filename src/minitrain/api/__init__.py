"""The public API: your model, your optimizer, your loop; minitrain's strategies underneath.

    rank, world = minitrain.init_distributed()
    model, optimizer = minitrain.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero=2)
    for x, y in batches:                      # this rank's share of the global batch
        loss = loss_fn(model(x), y)
        loss.backward()                       # gradients are averaged over the ranks for you
        minitrain.clip_grad_norm_(model, 1.0)  # the true global norm, the same on every rank
        optimizer.step()
        optimizer.zero_grad()
    minitrain.save_checkpoint("ckpt", model, optimizer, step)

`prepare` returns the same model object (its names and state_dict keys unchanged; its class a subclass of its own,
of the same name, with DDP's and FSDP2's methods: ddp_idioms.py) and an optimizer that behaves like the user's own
(its param_groups are the user's groups, so an LR scheduler works on it). `optimizer` is the user's torch optimizer,
made over the model's parameters as a DDP script makes it before the wrap (user_optimizer.py), or what makes one.
Underneath, the trainable parameters live in flat buffers, sharded by the ZeRO stage asked for, and the user's
optimizer runs on this rank's shard (parallel/core/shard_optimizer.py).
The CLI trainer goes through the same `parallelize` path with MiniGPT and its own optimizer.

Every call that moves data between ranks is collective: all ranks make it, in the same order. The ones a loop makes
on one rank by mistake (save_checkpoint, load_checkpoint, full_state_dict, barrier, optimizer.state_dict() over
shards, a ZeRO-3 evaluation) first check that every rank came (runtime/arrival.py), and stop every rank naming
each rank's line rather than hang or pair with another collective.

The package, one job per file: session.py (init_distributed, cleanup, which rank is which), prepare.py,
steps.py (no_sync, clip_grad_norm_, pipeline_step), context.py (context_shard), moe_stats.py (a mixture of experts' load and
router loss), optimizer.py (what prepare returns as the optimizer),
checkpoints.py (save, load, full_state_dict), scaler.py (fp16's GradScaler), servers.py (prepare(servers=...)),
user_optimizer.py (an optimizer made before prepare), ddp_idioms.py (DDP's and FSDP2's methods on the model).
"""
from __future__ import annotations

from ..parallel.pipeline_parallel.split import PipelineSplit
from .checkpoints import full_state_dict, load_checkpoint, save_checkpoint
from .optimizer import PreparedOptimizer
from .moe_stats import MoEStats, moe_stats
from .prepare import prepare
from .scaler import GradScaler
from .servers import is_server, serve
from .session import (
    barrier,
    cleanup,
    dp_rank,
    dp_world_size,
    init_distributed,
    is_main_process,
    wrap_for_ddp,
)
from .context import context_shard
from .steps import clip_grad_norm_, no_sync, pipeline_step

__all__ = [
    "GradScaler",
    "MoEStats",
    "PipelineSplit",
    "PreparedOptimizer",
    "barrier",
    "cleanup",
    "clip_grad_norm_",
    "context_shard",
    "dp_rank",
    "dp_world_size",
    "full_state_dict",
    "init_distributed",
    "is_main_process",
    "is_server",
    "load_checkpoint",
    "moe_stats",
    "no_sync",
    "pipeline_step",
    "prepare",
    "save_checkpoint",
    "serve",
    "wrap_for_ddp",
]
