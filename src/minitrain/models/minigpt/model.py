"""MiniGPT: a small GPT-style decoder. Knows nothing of parallelism.

Parallel strategies act on this model from the outside (flattening its
parameters, splitting its layers), following its plan (models/minigpt/plan.py), so
this file imports nothing from torch.distributed, reshapes heads with -1 (a
tensor-parallel split may leave a rank fewer heads than the config says), keeps
blocks in a ModuleDict so a pipeline split can drop blocks by name, and runs
whichever parts it still has (torchtitan's convention): without its embeddings
it takes hidden states in, without its head it gives hidden states out. The
loss is a submodule, so a tensor-parallel split can put a vocabulary-parallel
one in its place.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...config import ModelConfig
from .moe import MoEMLP


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.explicit = cfg.attention == "explicit"
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, 3, nh, hs): -1 heads because a tensor-parallel split may hold fewer.
        qkv = self.qkv(x).view(B, T, 3, -1, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
        y = self.attend(q, k, v).transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hs)
        return self.proj(y)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hs) + causal mask) v. Its own method because it is the cheap part (no
        weights) that selective activation checkpointing recomputes instead of storing.

        By default PyTorch's fused kernel (scaled_dot_product_attention, causal): flash attention
        where the device and dtype have it, which never materialises the (B, nh, T, T) scores.
        --model.attention explicit spells the same math out below (readable, and it shows what the
        fused kernel saves); the two agree to 1e-12 in float64 (tests/models/test_model.py)."""
        if not self.explicit:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        # An explicit causal mask: the masking is visible and tested directly.
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return att @ v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoEMLP(cfg) if cfg.moe_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MiniGPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.criterion = nn.CrossEntropyLoss()  # mean token cross-entropy
        self.apply(self._init_weights)
        # GPT-2's scaled init for the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) token ids. Returns logits (B, T, V), or the mean
        token cross-entropy when targets are given. A pipeline stage without the
        embeddings takes (B, T, C) hidden states instead of ids; one without the
        head returns hidden states."""
        x = self.embed(idx) if self.tok_emb is not None else idx
        for block in self.blocks.values():
            x = block(x)
        return self.output(x, targets) if self.head is not None else x

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) token + position embeddings."""
        T = idx.size(1)
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds seq_len {self.cfg.seq_len}")
        return self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))

    def output(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, C) last hidden state -> logits (B, T, V), or the loss when targets are given."""
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = self.criterion(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        # A mixture of experts' auxiliary losses (moe.py) count in the gradient, not in the value: the loss reads
        # as the language model's (x - x is exactly 0), and is scaled and averaged as it is.
        aux = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        if aux and torch.is_grad_enabled():
            total = torch.stack(aux).sum().to(loss.dtype)
            loss = loss + (total - total.detach())
        return loss

    def moe_layers(self) -> list[MoEMLP]:
        """The blocks' mixture-of-experts layers (none in a dense model)."""
        return [b.mlp for b in self.blocks.values() if isinstance(b.mlp, MoEMLP)]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
