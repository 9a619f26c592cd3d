"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): the layers that split a model's matrices
across the tensor-parallel group. Which layer of a model becomes which is the model's plan
(MiniGPT's: models/minigpt/plan.py); this file knows no model.

Two conjugate operators carry all the communication (the paper's Figure 3):
  f  identity in forward, all-reduce in backward. Where a replicated activation enters a
     column-parallel layer: each rank's input gradient covers only its columns' paths, so
     the full input gradient is their sum.
  g  all-reduce in forward, identity in backward. Where row-parallel partial outputs meet:
     each rank has multiplied only its slice of the inner dimension.
A block is then f -> column-parallel -> (local work) -> row-parallel -> g, twice (attention and
MLP): two all-reduces in forward, two in backward, and nothing in between.

- Attention is split by heads: qkv is column-parallel (each rank keeps the q, k and v rows of its
  heads), the output projection row-parallel (the columns of those heads).
- The MLP: up column-parallel, down row-parallel (GELU is elementwise, so it needs no exchange).
- The vocabulary: the token embedding keeps rows [lo, hi) of the vocabulary on each rank (ids
  outside give zeros, and g sums the ranks' lookups); the LM head is column-parallel over the
  same rows, so each rank computes only its slice of the logits; the cross-entropy works on the
  slices (a max, a sum of exponentials and the target's logit, each all-reduced): the full
  logits never exist on one rank. Tied weights stay tied: the head uses the embedding's shard.
- LayerNorms, the position embedding and row-parallel biases are replicated; their gradients
  come out identical on every rank, because every path into them passes f or g.

Each layer says which of its parameters are slices of a larger one, and where they come from
(`slices`); `tensor_parallel_slices(model)` collects them by parameter name for the strategy, so
that a global gradient norm sums their squares across the group (counting replicated ones once)
and a checkpoint puts their elements back in the whole model's coordinates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...runtime.comm import Comm
from ..state.slices import sharded_parameter


class _CopyToTensorParallel(torch.autograd.Function):
    """f: identity in forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce_sum(grad)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce_sum(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dimension in forward (every rank's slice, in rank order), this rank's
    slice of the gradient in backward: for a column-parallel output that the code after it reads whole
    (a Hugging Face head whose logits the user's loss takes). Every rank then computes the same thing
    from the whole output, so its gradient is already the whole gradient: no sum, just the slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm, ctx.width = comm, x.size(-1)
        pieces = x.new_empty((comm.world_size, *x.shape))
        comm.all_gather(pieces.view(-1), x.contiguous().view(-1))
        return pieces.movedim(0, -2).reshape(*x.shape[:-1], comm.world_size * x.size(-1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo = ctx.comm.rank * ctx.width
        return grad[..., lo:lo + ctx.width].contiguous(), None


def copy_to_tensor_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, comm)


class ColumnParallelLinear(nn.Module):
    """y_r = f(x) A_r^T + b_r: this rank's output features `rows` of a full nn.Linear. The output
    stays split (the next layer is row-parallel, or the vocabulary-parallel loss), or with
    gather_output is all-gathered whole (then `rows` must be this rank's contiguous share)."""

    def __init__(self, full: nn.Linear, rows: torch.Tensor, comm: Comm, gather_output: bool = False):
        super().__init__()
        self.comm, self.gather_output = comm, gather_output
        self.weight, weight = sharded_parameter(full.weight, 0, rows)
        self.slices = {"weight": weight}
        self.bias = None
        if full.bias is not None:
            self.bias, self.slices["bias"] = sharded_parameter(full.bias, 0, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel(x, self.comm), self.weight, self.bias)
        return _GatherFromTensorParallel.apply(y, self.comm) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = g(x_r B_r^T) + b: this rank's input features `cols` of a full nn.Linear, applied to the
    matching slice of a split input; the bias is replicated and added once, after the sum."""

    def __init__(self, full: nn.Linear, cols: torch.Tensor, comm: Comm):
        super().__init__()
        self.comm = comm
        self.weight, weight = sharded_parameter(full.weight, 1, cols)
        self.slices = {"weight": weight}
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding table; ids outside the range look up zeros, and g sums the ranks."""

    def __init__(self, full: nn.Embedding, lo: int, hi: int, comm: Comm):
        super().__init__()
        self.comm, self.lo, self.hi = comm, lo, hi
        self.weight, weight = sharded_parameter(full.weight, 0, torch.arange(lo, hi))
        self.slices = {"weight": weight}
        # A padding row gets no gradient (nn.Embedding's padding_idx), on the rank that holds it.
        pad = full.padding_idx
        self.padding_idx = pad - lo if pad is not None and lo <= pad < hi else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        local = (ids - self.lo).masked_fill(outside, 0)  # outside ids' rows come out zero, with zero gradient
        out = F.embedding(local, self.weight, padding_idx=self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(out, self.comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from logits split over the vocabulary: loss_i = log sum_v exp(z_iv) - z_i,t.
    Each rank holds columns [lo, lo + V/T); three all-reduces assemble the global max, the sum of
    exponentials and the target's logit. Backward is local: softmax minus one-hot, on the slice."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, lo: int, comm: Comm) -> torch.Tensor:
        # Under autocast the head's logits are 16-bit; the loss works in float32 (as F.cross_entropy does).
        z = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        top = z.max(dim=-1).values
        comm.all_reduce_max(top)
        shifted = z - top.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce_sum(sum_exp)
        mine = (targets >= lo) & (targets < lo + z.size(-1))
        local = (targets - lo).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        comm.all_reduce_sum(target_logit)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine)
        ctx.logits_dtype = logits.dtype
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.size(0), device=grad_logits.device)
        grad_logits[rows, local] -= mine.to(grad_logits.dtype)
        grad_logits.mul_(grad / grad_logits.size(0))
        return grad_logits.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, lo: int, comm: Comm) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, targets, lo, comm)


class VocabParallelCrossEntropy(nn.Module):
    """Mean cross-entropy of logits split evenly over the vocabulary: rank r holds entries
    [r x width, (r + 1) x width), as a vocabulary-parallel head gives them."""

    def __init__(self, comm: Comm):
        super().__init__()
        self.comm = comm

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.comm.rank * logits.size(-1), self.comm)


def even_split(n: int, comm: Comm) -> tuple[int, int]:
    """This rank's [lo, hi) of n things split evenly over the group (the degree divides n)."""
    size = n // comm.world_size
    return comm.rank * size, (comm.rank + 1) * size
