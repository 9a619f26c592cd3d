"""Mixed precision for a run: the dtypes it computes, reduces and keeps its master weights in, and its fp16 loss
scaler (the policy itself is parallel/core/loss_scale.py, shared with minitrain.prepare).

The recipe of Micikevicius et al. (2018), in the ZeRO paper's accounting: parameters and
gradients in 16 bits (2 + 2 bytes per parameter), and the optimizer updates a float32 master
copy with float32 Adam m and v (K = 12 bytes per parameter). After each update the master
is rounded back into the 16-bit parameters. Forward runs under `torch.autocast`, which keeps
the ops that lose most in 16 bits in float32 (the cross-entropy on every device; on CUDA
also softmax and LayerNorm).

bf16 has float32's exponent range and needs nothing more. fp16 has five exponent bits:
gradients below ~6e-8 flush to zero. Dynamic loss scaling multiplies the loss by a large
power of two before backward (so the gradients are scaled too and stay representable) and
divides it out, in float32, before the update.

`--reduce-dtype` picks what gradients are summed across ranks in: float32 (default, as
torchtitan and Megatron; the sum of N 16-bit values loses least) or the compute dtype (half
the bytes on the wire and, at ZeRO-2/3, a 16-bit gradient shard, as in the ZeRO paper).
"""
from __future__ import annotations

import contextlib

import torch

from ..config import TrainConfig
from ..parallel.core.loss_scale import COMPUTE_DTYPES, LossScaler


def master_dtype(cfg: TrainConfig) -> torch.dtype:
    """The optimizer's master weights and state: --dtype (float32, or float64 for parity runs)."""
    return getattr(torch, cfg.dtype)


def compute_dtype(cfg: TrainConfig) -> torch.dtype:
    """Parameters, activations and the gradients autograd produces."""
    return COMPUTE_DTYPES.get(cfg.precision, master_dtype(cfg))


def reduce_dtype(cfg: TrainConfig) -> torch.dtype:
    """What gradients are summed across ranks in (and, at ZeRO-2/3, the gradient shard's dtype)."""
    if cfg.precision == "fp32" or cfg.reduce_dtype == "compute":
        return compute_dtype(cfg)
    return torch.float32


def autocast(cfg: TrainConfig, device: torch.device):
    """The context forward runs in: autocast to the compute dtype, or nothing in full precision."""
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype(cfg))


def make_loss_scaler(cfg: TrainConfig) -> LossScaler | None:
    """A scaler for fp16; None otherwise (bf16 and fp32 have float32's range)."""
    return LossScaler(cfg.loss_scale_init, cfg.loss_scale_window) if cfg.precision == "fp16" else None
