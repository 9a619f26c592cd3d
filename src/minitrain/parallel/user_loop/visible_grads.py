"""What a loop ported from DistributedDataParallel sees in `p.grad` (the API's strategies; the CLI trainer reads
no p.grad and keeps none of this).

DDP's guarantee is that when `loss.backward()` returns (outside no_sync), every `p.grad` holds the gradient
averaged over the ranks, so `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` clips by the true norm.
- At ZeRO-0/1 the gradients are views of the flat buffer: `BackwardEndSync` finishes the bucketed all-reduce
  and the division by N in a callback the autograd engine runs when backward ends (DDP does the same), so a
  loop reads averaged gradients, and its in-place changes (torch's clipping) are what the optimizer applies.
  Where a torch norm would not be the global one (tensor-parallel slices, pipeline stages) or where the
  optimizer reads a wider copy (bf16 gradients summed in float32), a change made after backward is refused at
  step() instead of being silently ignored or misapplied (`VisibleGradGuard`).
- At ZeRO-2/3 each gradient is reduce-scattered into a shard as backward produces it and exists nowhere whole.
  `p.grad` is then a `ShardedGradient`: a tensor without data whose every use raises, naming
  `minitrain.clip_grad_norm_` (torch's clip_grad_norm_ would see no gradients and return 0.0, clipping
  nothing). The next backward accumulates through it as through a zero.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves


class ShardedGradient(torch.Tensor):
    """The `.grad` of a parameter whose gradient lives sharded across ranks: shaped like it, holding nothing."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str, stage: int):
        grad = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        grad.param_name, grad.stage, grad.pending = name, stage, None
        return grad

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sentinel = next((a for a in args if isinstance(a, ShardedGradient)), None)
        if sentinel is None:  # in a list, for a foreach op: torch's GradScaler unscales every gradient in one
            sentinel = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, ShardedGradient))
        other = next((a for a in args if isinstance(a, torch.Tensor) and not isinstance(a, ShardedGradient)), None)
        # Autograd accumulating the next backward's gradient: the sentinel counts as zero and carries it to the
        # post-accumulate hook (ZeRO-2's _grad_ready), which reduces it.
        if func is torch.ops.aten.add_.Tensor and args[0] is sentinel and kwargs.get("alpha", 1) == 1:
            sentinel.pending = other if sentinel.pending is None else sentinel.pending + other
            return sentinel
        if func is torch.ops.aten.add.Tensor and other is not None and kwargs.get("alpha", 1) == 1:
            return other
        if func is torch.ops.aten.detach.default:
            return sentinel
        raise RuntimeError(
            f"the gradient of '{sentinel.param_name}' is sharded across ranks at ZeRO-{sentinel.stage} "
            f"(reduce-scattered as backward produced it), so p.grad holds no values ({func} cannot read it): clip with "
            "minitrain.clip_grad_norm_(model, max_norm), which takes the global norm over every shard, and scale an "
            "fp16 loss with prepare(precision='fp16') and minitrain.GradScaler (torch's reads p.grad); read whole "
            "gradients at zero=0 or 1")

    def __repr__(self, *, tensor_contents=None):
        return f"ShardedGradient('{self.param_name}', ZeRO-{self.stage}, shape={tuple(self.shape)})"

    def take(self) -> torch.Tensor | None:
        """The gradient autograd accumulated into this sentinel, if any, handed over once."""
        pending, self.pending = self.pending, None
        return pending


class BackwardEndSync:
    """Calls `finish()` once when the autograd engine ends a backward in which some flattened parameter got a
    gradient, unless `suspended()` (inside no_sync)."""

    def __init__(self, params: list[torch.nn.Parameter], finish: Callable[[], None], suspended: Callable[[], bool]):
        self.finish, self.suspended, self._queued = finish, suspended, False
        self.handles = [p.register_post_accumulate_grad_hook(self._touched) for p in params]

    def _touched(self, _param) -> None:
        if not self._queued and not self.suspended():
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._at_end)

    def _at_end(self) -> None:
        self._queued = False
        self.finish()


class VisibleGradGuard:
    """A fingerprint of the visible gradients taken when the sync finishes, compared at step(): a change in
    between (torch's clip_grad_norm_ on the slices or stages this rank holds, or on bf16 gradients whose float32
    sum the optimizer reads) raises instead of training on a norm that is not the model's."""

    def __init__(self, why: str):
        self.why, self._fingerprint = why, None

    def take(self, grad: torch.Tensor) -> None:
        self._fingerprint = grad.detach().double().square().sum()

    def check(self, grad: torch.Tensor) -> None:
        if self._fingerprint is None:
            return
        before, self._fingerprint = self._fingerprint, None
        now = grad.detach().double().square().sum()
        if not bool((now == before) | (now.isnan() & before.isnan())):  # a NaN gradient is unchanged too
            raise RuntimeError(f"p.grad was changed between backward and optimizer.step() ({self.why}, so a norm "
                               "torch computes from p.grad is not the model's): clip with "
                               "minitrain.clip_grad_norm_(model, max_norm)")


class VisibleGradients:
    """p.grad in a user's loop at ZeRO-0/1: views of the flat gradient buffer that hold the averaged gradient once
    backward ends (sync_when_backward_ends), with a guard where a change to them could not be honoured (show).

    A gradient autograd made afresh because p.grad had been set to None (model.zero_grad(), torch's default
    set_to_none) is copied into its place in the flat buffer, which p.grad then views again: torch's meaning (a
    fresh start for that gradient) kept, and the sync sees it. Its hooks (`handles`) are registered before the
    sync's own. As a model fresh from torch, no p.grad is set before the first backward."""

    def __init__(self, flat):
        self.flat = flat
        self.kept: list[torch.nn.Parameter] = []
        self.handles: list = []
        self.guard: VisibleGradGuard | None = None  # refuses p.grad changed after a sync

        def keep(p, view):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

        for seg in flat.segments:
            if seg.numel:
                view = flat.grad[seg.offset:seg.offset + seg.numel].view(seg.shape)
                self.kept.append(flat.param(seg))
                self.handles.append(flat.param(seg).register_post_accumulate_grad_hook(
                    lambda p, view=view: keep(p, view)))
        self.drop()

    def drop(self) -> None:
        """torch's zero_grad(set_to_none=True): p.grad is None until the next backward."""
        for p in self.kept:
            p.grad = None

    def sync_when_backward_ends(self, sync: Callable[[], None], suspended: Callable[[], bool]) -> list:
        """Run `sync` in the autograd engine's end-of-backward callback, unless `suspended()` (no_sync); returns
        the hooks' handles."""
        return BackwardEndSync([self.flat.param(s) for s in self.flat.segments], sync, suspended).handles

    def show(self, averaged: torch.Tensor, tp_split: bool, pp_split: bool) -> None:
        """p.grad hold `averaged`: a wider averaged copy is rounded into them; a fingerprint is taken where a change
        before step() could not be honoured. tp_split: the model's tensors are sliced over ranks (by tensor or
        expert parallelism)."""
        if averaged is not self.flat.grad:
            self.flat.grad.copy_(averaged)
        why = ("the model's tensors are split over ranks (tensor or expert parallelism)" if tp_split else
               "the model is split over pipeline stages" if pp_split else
               "the optimizer steps on their sum in a wider dtype, not on p.grad" if averaged is not self.flat.grad
               else None)
        if why is not None:
            self.guard = self.guard or VisibleGradGuard(why)
            self.guard.take(self.flat.grad)
