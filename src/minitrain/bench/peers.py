"""PyTorch's own sharded training on our model, data and schedule: the peers ZeRO is checked against.

- "ddp": DistributedDataParallel and torch.optim.AdamW (nothing sharded: stage 0).
- "zero-redundancy": DistributedDataParallel for the gradient all-reduce plus
  torch.distributed.optim.ZeroRedundancyOptimizer (optimizer state sharded: ZeRO-1).
- "fsdp2-zero2": fully_shard with reshard_after_forward=False: parameters stay
  gathered from forward until backward is done, gradients and optimizer state
  sharded (between steps parameters are sharded too, unlike our ZeRO-2).
- "fsdp2": torch.distributed.fsdp.fully_shard on every block and then the root
  (parameters, gradients and optimizer state sharded: ZeRO-3), as torchtitan applies it.

In bf16/fp16 only the FSDP2 peers run (DDP keeps parameters in one dtype): their
MixedPrecisionPolicy casts the float32 parameters to the compute dtype when it gathers them
and reduces gradients in the reduce dtype, with forward under the same autocast as ours. So
the recipe matches ZeRO-3's float32 master rounded into a 16-bit shard. (No fp16 loss scaling
on the peer side: compare fp16 only where nothing overflows.)

Both use torch.optim.AdamW with the same decay / no-decay split, the same LR
schedule, global-norm clipping (clip_grad_norm_) and the same ShardedLoader,
so on identical initial weights the loss curves must agree with ours to
floating-point tolerance. They drive torch's collectives themselves on our
process group; only the per-step loss exchange goes through our comm layer.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import RunConfig
from ..data import make_loader
from ..models.minigpt.model import MiniGPT
from ..train.optim import lr_at
from ..train.precision import autocast, compute_dtype, reduce_dtype
from ..runtime.topology import Topology

PEERS = ("ddp", "zero-redundancy", "fsdp2-zero2", "fsdp2")
STAGE_OF = {"ddp": 0, "zero-redundancy": 1, "fsdp2-zero2": 2, "fsdp2": 3}


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices and embeddings decay; biases and LayerNorm gains do not (as FlatAdamW)."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class PeerTrainer:
    def __init__(self, cfg: RunConfig, topo: Topology, peer: str):
        if peer not in PEERS:
            raise ValueError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")
        if topo.dp.group is None:
            raise RuntimeError("the PyTorch peers need a process group: launch ranks (even one) with the launcher")
        self.cfg, self.topo, self.peer = cfg, topo, peer
        t = cfg.train
        if t.precision != "fp32" and not peer.startswith("fsdp2"):
            raise ValueError(f"peer {peer!r} trains in one dtype; with --precision {t.precision} use fsdp2 or "
                             "fsdp2-zero2")
        torch.manual_seed(t.seed)  # every rank builds the same initial weights, as our Trainer does
        self.model = MiniGPT(cfg.model).to(device=topo.device, dtype=getattr(torch, t.dtype))
        adam = {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": t.eps}
        if peer in ("ddp", "zero-redundancy"):
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [topo.device] if topo.device.type == "cuda" else None
            self.module = DistributedDataParallel(self.model, device_ids=device_ids, process_group=topo.dp.group)
            groups = decay_groups(self.model, t.weight_decay)
            if peer == "ddp":
                self.optimizer = torch.optim.AdamW(groups, **adam)
            else:
                self.optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                                         process_group=topo.dp.group, weight_decay=t.weight_decay,
                                                         **adam)
                self.optimizer.add_param_group(groups[1])
        else:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = DeviceMesh.from_group(topo.dp.group, topo.device.type)
            shard = {"mesh": mesh, "reshard_after_forward": peer == "fsdp2"}
            if t.precision != "fp32":
                shard["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype(t), reduce_dtype=reduce_dtype(t))
            for block in self.model.blocks.values():
                fully_shard(block, **shard)
            self.module = fully_shard(self.model, **shard)
            # After fully_shard: it replaces every parameter with a sharded DTensor parameter.
            self.optimizer = torch.optim.AdamW(decay_groups(self.model, t.weight_decay), **adam)
        self.loader = make_loader(cfg, topo.rank, topo.world_size, prefetch=cfg.data.prefetch)  # the trainer's data path
        self.step = 0

    def train_step(self) -> float:
        """One optimizer step; returns the loss averaged over ranks and micro-batches."""
        t, device = self.cfg.train, self.topo.device
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for micro in range(t.grad_accum):
            x, y = self.loader.next_batch()
            with autocast(t, device):
                loss = self.module(x.to(device), y.to(device))
            (loss / t.grad_accum).backward()
            loss_sum += loss.detach().double().cpu()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, t)
        self.optimizer.step()
        self.step += 1
        return float(self.topo.dp.gather_rows((loss_sum / t.grad_accum).reshape(1))[:, 0].mean())
