"""A training loop written for FSDP2, written here, the way torchtitan-style scripts write one: fully_shard on
each block and then on the model, the optimizer made after over the sharded parameters, accumulation by
set_requires_gradient_sync, and get_model_state_dict / get_optimizer_state_dict (collective, every rank) to save,
rank 0 writing the file. tests/system/test_porting.py swaps the lines marked `# FSDP2` for minitrain's and compares the
runs. Float64, so that the comparison can ask for 1e-12; run under torchrun (or what sets its environment).

Argument: a JSON object of settings (see CONFIG); it writes out_dir/record-rank{R}.json and, on rank 0,
out_dir/final.pt (the model and optimizer state at the end).
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # FSDP2
                                                     get_optimizer_state_dict)  # FSDP2
from torch.distributed.fsdp import fully_shard  # FSDP2

CONFIG = {"out_dir": "out", "steps": 5, "accumulate": 2, "batch_size": 2, "seq": 8, "lr": 2e-2, "grad_clip": 0.5}
config = {**CONFIG, **json.loads(sys.argv[1] if len(sys.argv) > 1 else "{}")}
torch.set_default_dtype(torch.float64)
VOCAB, WIDTH = 32, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # every rank builds the same model, as FSDP2 expects
model = Model()
for layer in model.layers:  # FSDP2
    fully_shard(layer)  # FSDP2
fully_shard(model)  # FSDP2
optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.1)


def batch(step, micro):
    g = torch.Generator().manual_seed((step * 100 + micro) * 16 + rank)
    x = torch.randint(0, VOCAB, (config["batch_size"], config["seq"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


record = {"train": {}}
for step in range(config["steps"]):
    for micro in range(config["accumulate"]):
        model.set_requires_gradient_sync(micro == config["accumulate"] - 1)
        inputs, targets = batch(step, micro)
        loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1)) / config["accumulate"]
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])  # FSDP2
    optimizer.step()
    optimizer.zero_grad()
    record["train"][step] = [loss.item() * config["accumulate"], float(norm)]

options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # FSDP2
state = {"model": get_model_state_dict(model, options=options),  # FSDP2
         "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}  # FSDP2
if rank == 0:
    torch.save(state, os.path.join(config["out_dir"], "final.pt"))
with open(os.path.join(config["out_dir"], f"record-rank{rank}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
