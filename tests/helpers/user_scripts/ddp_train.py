"""A training script shaped like nanoGPT's train.py, written here, the way a DDP user writes one: run it under
torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

What it does as nanoGPT does: its own init_process_group and destroy_process_group; every rank seeds itself
differently before building the model; the optimizer (two AdamW param groups) is made, and on resume loaded from a
torch.save'd checkpoint, before the model is wrapped; a cosine learning rate written into each param_group['lr'];
gradient accumulation by DDP's require_backward_grad_sync; torch's clip_grad_norm_; evaluation and checkpoint
saving on rank 0 only, raw_model = model.module. tests/system/test_porting.py swaps the lines marked `# DDP` for
minitrain's and compares the runs. Float64, so that the comparison can ask for 1e-12.

Argument: a JSON object of settings (see CONFIG); it writes out_dir/record-rank{R}.json (its losses).
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP  # DDP

CONFIG = {"out_dir": "out", "init_from": "scratch", "max_iters": 6, "eval_interval": 3, "eval_iters": 2,
          "gradient_accumulation_steps": 4, "batch_size": 2, "block_size": 8, "learning_rate": 3e-2,
          "warmup_iters": 2, "lr_decay_iters": 8, "min_lr": 3e-3, "weight_decay": 0.1, "grad_clip": 0.5,
          "always_save_checkpoint": True, "zero": 0}
config = {**CONFIG, **json.loads(sys.argv[1] if len(sys.argv) > 1 else "{}")}
globals().update(config)
torch.set_default_dtype(torch.float64)
VOCAB, WIDTH = 32, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        q, k, v = self.attn(self.ln_1(x)).split(WIDTH, dim=2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(block_size, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    gradient_accumulation_steps //= ddp_world_size
else:
    ddp_rank, ddp_world_size, master_process, seed_offset = 0, 1, True, 0
torch.manual_seed(1337 + seed_offset)  # every rank makes a different model: the wrap gives them rank 0's
data = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(0))


def get_batch(split, it, micro):
    """Each rank's own batch, drawn from (split, iteration, micro-step, rank) alone: a resumed run reads what the
    uninterrupted one read."""
    g = torch.Generator().manual_seed(((it * 10000 + micro) * 2 + (split == "val")) * 64 + ddp_rank)
    part = data[:300] if split == "train" else data[300:]
    ix = torch.randint(len(part) - block_size, (batch_size,), generator=g)
    return (torch.stack([part[i:i + block_size] for i in ix]),
            torch.stack([part[i + 1:i + 1 + block_size] for i in ix]))


iter_num, best_val_loss = 0, 1e9
model = GPT()
if init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)
    model.load_state_dict(checkpoint["model"])
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
optimizer = model.configure_optimizers(weight_decay, learning_rate, (0.9, 0.95))
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None
if ddp:
    model = DDP(model)  # DDP
raw_model = model.module if ddp else model  # DDP


@torch.no_grad()
def estimate_loss(it):
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split, it, 1000 + k)
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


record = {"train": {}, "eval": {}}
X, Y = get_batch("train", iter_num, 0)
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss(iter_num)
        record["eval"][iter_num] = losses
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                              "iter_num": iter_num, "best_val_loss": best_val_loss}
                torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train", iter_num + (micro_step + 1) // gradient_accumulation_steps,
                         (micro_step + 1) % gradient_accumulation_steps)
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    record["train"][iter_num] = loss.item() * gradient_accumulation_steps
    iter_num += 1
    if iter_num > max_iters:
        break

with open(os.path.join(out_dir, f"record-rank{ddp_rank}.json"), "w") as f:
    json.dump(record, f)
if ddp:
    destroy_process_group()
