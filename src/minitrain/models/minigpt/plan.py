"""MiniGPT's plan (parallel/core/model_plan.py): its tensor-parallel layers, pipeline split and
recomputation targets. The model file knows none of this.

Tensor parallel (Megatron-LM's split, parallel/tensor_parallel/layers.py has the layers):
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

Context parallel: the attention cores are `attend` (q, k, v in, the weighted values out: the same method selective
recomputation names), and the learned position embedding is looked up at the positions of a rank's tokens.
"""
from __future__ import annotations

import functools

from torch import nn

from .model import MiniGPT
from ...parallel.core.model_plan import ModelPlan
from ...parallel.pipeline_parallel.executor import chunk_blocks, stage_blocks
from ...parallel.tensor_parallel.plans import Colwise

# In the plan format any model's plan uses (parallel/tensor_parallel/plans.py): module-name patterns to styles.
TENSOR_PARALLEL = {
    "blocks.*.attn.qkv": Colwise(parts=3),  # q, k and v rows of this rank's heads
    "blocks.*.attn.proj": "rowwise",         # the columns of those heads
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "tok_emb": "vocab_embedding",
    "head": "vocab_head",                    # the same vocabulary rows: a tied head stays tied
    "criterion": "vocab_loss",
}


def pipeline_split(model: MiniGPT, stage: int, stages: int) -> None:
    if stages > 1:
        _keep(model, set(stage_blocks(len(model.blocks), stages)[stage]), stage, stages)


def _keep(model: MiniGPT, blocks: set[int], stage: int, stages: int) -> None:
    """Delete the blocks this stage does not hold, the embeddings unless it is the first, the final LayerNorm and
    head unless it is the last."""
    for name in list(model.blocks):
        if int(name) not in blocks:
            del model.blocks[name]
    if stage > 0:
        model.tok_emb = model.pos_emb = None
    if stage < stages - 1:
        model.ln_f = model.head = None


def pipeline_chunks(model: MiniGPT, stage: int, stages: int, virtual: int) -> list:
    """The interleaved schedule's split, in place: stage s keeps virtual stages s, s + P, ... (each a contiguous
    run of blocks, stage_blocks over P x V), the embeddings if it holds the first, the final LayerNorm, head and
    loss if it holds the last; returns each chunk's forward(x, targets or None), in chunk order."""
    mine = chunk_blocks(len(model.blocks), stage, stages, virtual)
    _keep(model, {i for chunk in mine for i in chunk}, stage, stages)
    return [functools.partial(_run_chunk, model, chunk, stage == 0 and c == 0, stage == stages - 1 and c == virtual - 1)
            for c, chunk in enumerate(mine)]


def _run_chunk(model: MiniGPT, chunk: range, first: bool, last: bool, x, targets):
    x = model.embed(x) if first else x
    for i in chunk:
        x = model.blocks[str(i)](x)
    return model.output(x, targets) if last else x


def blocks(model: MiniGPT) -> list[nn.Module]:
    return list(model.blocks.values())


def selective(model: MiniGPT) -> list[tuple[nn.Module, str]]:
    return [(block.attn, "attend") for block in model.blocks.values()]


def positions(model: MiniGPT) -> list[tuple[nn.Module, int]]:
    return [(model.pos_emb, 0)] if model.pos_emb is not None else []


MINIGPT_PLAN = ModelPlan(tensor_parallel=TENSOR_PARALLEL, pipeline_split=pipeline_split, blocks=blocks,
                         selective=selective, attention=selective, positions=positions,
                         pipeline_chunks=pipeline_chunks)
