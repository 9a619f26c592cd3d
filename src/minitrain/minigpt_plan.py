"""MiniGPT's plan (parallel/model_plan.py): its tensor-parallel layers, pipeline split and
recomputation targets. The model file knows none of this.

Tensor parallel (Megatron-LM's split, parallel/tensor.py has the layers):
- attention by heads: qkv column-parallel (each rank keeps the q, k and v rows of its heads), the
  output projection row-parallel (the columns of those heads);
- the MLP: up column-parallel, down row-parallel (GELU is elementwise, so it needs no exchange);
- the vocabulary: the token embedding keeps rows [lo, hi), the head is column-parallel over the same
  rows (tied weights stay tied: the head uses the embedding's slice), and the loss is the
  vocabulary-parallel cross-entropy, so the full logits never exist on one rank.
LayerNorms, the position embedding and row-parallel biases are replicated. Degrees must divide
the heads, the MLP width and the vocabulary (config validation says so first).

Pipeline: stage s keeps blocks `stage_blocks(n_layer, P)[s]`, the embeddings on the first stage,
the final LayerNorm, head and loss on the last; MiniGPT's forward runs the parts it has.
"""
from __future__ import annotations

import torch
from torch import nn

from .comm import Comm
from .model import MiniGPT
from .parallel.model_plan import ModelPlan
from .parallel.pipeline import stage_blocks
from .parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelCrossEntropy,
                              VocabParallelEmbedding, even_split)


def tensor_parallel(model: MiniGPT, comm: Comm) -> None:
    if comm.world_size == 1:
        return
    cfg = model.cfg
    for block in model.blocks.values():
        attn, mlp = block.attn, block.mlp
        head_cols = torch.arange(*even_split(cfg.d_model, comm))  # this rank's heads, as columns of the width
        qkv_rows = torch.cat([head_cols + part * cfg.d_model for part in range(3)])  # its q, k and v rows
        attn.qkv = ColumnParallelLinear(attn.qkv, qkv_rows, comm)
        attn.proj = RowParallelLinear(attn.proj, head_cols, comm)
        ff = torch.arange(*even_split(cfg.ffn_dim, comm))
        mlp.up = ColumnParallelLinear(mlp.up, ff, comm)
        mlp.down = RowParallelLinear(mlp.down, ff, comm)
    lo, hi = even_split(cfg.vocab_size, comm)
    tied = model.head.weight is model.tok_emb.weight
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, lo, hi, comm)
    model.head = ColumnParallelLinear(model.head, torch.arange(lo, hi), comm)
    if tied:
        model.head.weight = model.tok_emb.weight
    model.criterion = VocabParallelCrossEntropy(lo, comm)


def pipeline_split(model: MiniGPT, stage: int, stages: int) -> None:
    if stages == 1:
        return
    keep = stage_blocks(len(model.blocks), stages)[stage]
    for name in list(model.blocks):
        if int(name) not in keep:
            del model.blocks[name]
    if stage > 0:
        model.tok_emb = model.pos_emb = None
    if stage < stages - 1:
        model.ln_f = model.head = None


def blocks(model: MiniGPT) -> list[nn.Module]:
    return list(model.blocks.values())


def selective(model: MiniGPT) -> list[tuple[nn.Module, str]]:
    return [(block.attn, "attend") for block in model.blocks.values()]


MINIGPT_PLAN = ModelPlan(tensor_parallel=tensor_parallel, pipeline_split=pipeline_split, blocks=blocks,
                         selective=selective)
