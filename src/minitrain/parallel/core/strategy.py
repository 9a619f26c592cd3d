"""The base of every data-parallel strategy: flat buffers (layout.py), a shard optimizer, the global
gradient norm and clipping, what a rank holds, and its checkpoint state.

`stage` says what is sharded across ranks, as in the ZeRO paper: 0 nothing, 1 optimizer state,
2 also gradients, 3 also parameters. The optimizer is built by a factory the caller passes
(`make_optimizer(master, flat, shard_ranges)`): minitrain's own `FlatAdamW` for the CLI, or a
user's torch optimizer over this rank's shard (`shard_optimizer.py`), so the strategies never
know which.

Longer than our ~400 lines on purpose: it is the one contract every strategy (ddp.py, zero.py, zero3.py)
fills in, and the step, the norm, the memory accounting and the checkpoint state read best beside each other.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn

from ...runtime.comm import Comm
from .config import ParallelConfig
from .flat_parameters import FlatParameters, Ranges, Segment, WholeModel, local_views, take
from .memory_math import MEMORY_KINDS, MemoryLedger, memory_terms, term_bytes, term_formula
from .norms import SquareSums, clip_coefficient, clip_coefficient_tensor
from .piece_vector import held_bytes
from ..state.placement import Placement, placements
from ..user_loop.visible_grads import BackwardEndSync, VisibleGradGuard

# (master, flat parameters, this rank's shard ranges) -> an optimizer over the shard (see FlatStrategy)
OptimizerFactory = Callable[[torch.Tensor, FlatParameters, Ranges], object]


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (unlike ==, tells -0.0 from 0.0 and matches NaNs)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Two state_snapshot()s (or any tensor dicts) equal byte for byte."""
    return a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)


def sync_figures(marks: tuple, clock, wait: bool = False) -> dict | None:
    """A sync's figures from its marks (FlatStrategy.sync_at): None while a mark is not done, unless `wait`."""
    buckets, intervals, backward_end = marks
    every = [m for pair in intervals for m in pair] + ([backward_end] if backward_end is not None else [])
    for mark in every if wait else ():
        clock.wait(mark)
    if not all(clock.ready(m) for m in every):
        return None
    seconds = [(clock.seconds(a), clock.seconds(b)) for a, b in intervals]
    end = None if backward_end is None else clock.seconds(backward_end)
    return {"buckets": buckets, **sync_summary(seconds, end)}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, done in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], done))
        else:
            merged.append((start, done))
    return merged


def sync_summary(intervals: list[tuple[float, float]], backward_end: float | None) -> dict:
    """Gradient-sync figures of one step from each collective's (launched, completed) times.

    allreduce_inflight_s: wall time during which any gradient collective was in flight (the
    union of the intervals: a backend runs queued async ops one after another, so their
    intervals overlap and a plain sum would count the queueing twice). overlap: the share of
    that time before backward ended, i.e. hidden behind compute (None when backward's end is
    not observable, as inside PyTorch DDP, whose wait happens within backward)."""
    merged = _union(intervals)
    inflight = sum(done - start for start, done in merged)
    hidden = None
    if backward_end is not None and inflight > 0:
        hidden = sum(max(0.0, min(done, backward_end) - start) for start, done in merged) / inflight
    return {"allreduce_calls": len(intervals), "allreduce_inflight_s": inflight, "overlap": hidden,
            "allreduce_ms": [round(1000 * (done - start), 3) for start, done in intervals]}


class FlatStrategy:
    """Shared machinery of data-parallel strategies over flat buffers.

    Subclasses set `name` and `stage` and implement `_averaged_grad()`, `_end_step()` and `_publish()`;
    they may override `no_sync()` and `finish_grad_sync()`. The trainer (or a user's loop, through
    `minitrain.prepare`) runs forward on `module` (the model, or a wrapper around it) and reads
    `last_sync` after each step.
    """

    name = "flat"
    stage = 0

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 units: list[tuple[str, list[str]]] | None = None, keep_grad: bool = True,
                 whole: WholeModel | None = None):
        self.model, self.comm, self.pcfg = model, comm, pcfg
        self.module: nn.Module = model
        self._last_sync: dict = {}
        self._sync_marks: tuple | None = None  # the last sync's clock marks, until they can be read (sync_at)
        self.ledger = MemoryLedger()
        # What this rank holds of the whole model (all of it, a pipeline stage, tensor-parallel slices), and the
        # placement of every entry of the whole model's state_dict (placement.py).
        self.whole = whole or WholeModel.of(model)
        # Data parallel shards nothing, so it pads nothing; ZeRO pads every unit to a multiple of N.
        self.flat = FlatParameters(model, comm.world_size if self.stage else 1, units, keep_grad, self.whole)
        # (Replicas start identical: parallelize gave every rank rank 0's model before it was split.)
        self.shard_ranges = self.ranges_of(comm.rank)
        # The master is in the master dtype even when the parameters are 16-bit (mixed precision). At ZeRO-0/1
        # in full precision it may be the parameters themselves: the shard is one contiguous range of the buffer.
        self.master_is_params = (pcfg.master_is_params and self.stage <= 1 and len(self.shard_ranges) == 1
                                 and self.flat.dtype == pcfg.master_dtype)
        if self.master_is_params:
            start, stop = self.shard_ranges[0]
            master = self.flat.data[start:stop]  # a view: the optimizer's update is the parameters' update
        else:
            master = take(self.flat.data, self.shard_ranges).to(pcfg.master_dtype)
        self.optimizer = make_optimizer(master, self.flat, self.shard_ranges)
        self.reduce_dtype = pcfg.reduce_dtype  # gradients are summed across ranks in this dtype
        # ZeRO-0/1 sum the whole gradient in it, through a copy when it is wider than the gradient; a group of one
        # sums nothing, so the gradient is used as it is (the optimizer upcasts it chunk by chunk, to the same
        # values). On an H200 the step's copies were about 2 ms of a 52 ms gpt2-124m step, this one among them.
        self.sum_dtype = self.flat.dtype if comm.alone else pcfg.reduce_dtype
        self.tp = Comm(device=comm.device)  # the tensor-parallel group, when the model is split (use_model_parallel)
        self.pp = Comm(device=comm.device)  # the pipeline group, when this rank holds one stage of the model
        self._tp_sharded: Ranges = []  # physical ranges of parameters split across tp (or ep: use_experts)
        self._ep: Comm | None = None  # expert parallelism that splits the weights (use_experts)
        self._settled = False  # this step's gradient settled over ep (_synced_grad)
        self._norm: torch.Tensor | None = None  # this step's global gradient norm, once computed
        self._visible_guard: VisibleGradGuard | None = None  # refuses p.grad changed after a sync (visible_grads.py)
        self._backward_end: BackwardEndSync | None = None  # syncs when backward ends (user_loop, stages 0-1)
        # Every hook this strategy puts on the model or its parameters: close() removes them, so a dropped model no
        # longer reaches the strategy (autograd would keep both alive) and the model is the user's own again.
        self.hooks: list = []
        self.closed = False  # close() was called: no further update (its gradients would no longer be synced)
        # No further step can be taken (parameter servers that another worker has left): the run stops.
        self.ending = False
        # Parameters whose fresh gradient _keep_grads_in_place copies into the flat buffer (a user's loop at ZeRO-0/1).
        self._kept_in_place: list[nn.Parameter] = []
        # A user's in-place edits of parameters the optimizer does not step directly (_take_in_place_edits).
        self._edit_watch: list[tuple[Segment, nn.Parameter]] = []
        self._versions: list[int] = []
        if pcfg.user_loop:
            self._follow_user_state_dict(model)
            self._watch_in_place_edits()
            if self.flat.grad is not None:
                self._keep_grads_in_place()
                self._drop_kept_grads()  # as a model fresh from torch: no p.grad before the first backward

    def close(self) -> None:
        """Take every hook this strategy put on the model off it. The strategy then holds no place in autograd or in
        the model's hook tables, so once its owner drops it (a finished Trainer, minitrain.cleanup()) it is freed,
        with the flat buffers and the optimizer state it holds."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        self.closed = True

    # --- the last step's gradient-sync figures ----------------------------------------------------------------
    def sync_at(self, buckets: int, intervals: list[tuple], backward_end) -> None:
        """Record the sync's collectives as (launched, completed) marks of the comm's clock, and backward's end
        (None where it cannot be observed): last_sync reads them once they are done (on a GPU, after the step's
        host synchronisation; on the CPU at once)."""
        self._sync_marks = (buckets, intervals, backward_end)

    @property
    def last_sync(self) -> dict:
        """The last step's gradient-sync figures (sync_summary), once its marks can be read."""
        if self._sync_marks is not None:
            figures = sync_figures(self._sync_marks, self.comm.clock)
            if figures is not None:
                self._last_sync, self._sync_marks = figures, None
        return self._last_sync

    def take_sync_marks(self) -> tuple | None:
        """The last sync's marks, for a caller that reads them itself later (sync_figures): the trainer, when it
        reads a step's figures after the next step has begun (and sets last_sync to them)."""
        marks, self._sync_marks = self._sync_marks, None
        return marks

    @last_sync.setter
    def last_sync(self, value: dict) -> None:
        self._last_sync, self._sync_marks = value, None

    def placements(self) -> list[Placement]:
        """How every entry of this rank's model's state_dict is held (placement.py), in the model's order."""
        return placements(self.model, self.whole.slices, self.whole.state)

    def use_model_parallel(self, tp: Comm, pp: Comm) -> None:
        """The model is split across other groups too: norms must cover the whole model. Tensor-parallel
        slices (WholeModel.slices) are split across `tp` (their squares are summed over the group,
        replicated parameters counted once); each rank of `pp` holds different parameters (a stage),
        so the squares are summed over it."""
        self.tp, self.pp = tp, pp
        self._tp_sharded = self.flat.ranges_of_names(self.flat.sliced)

    def use_experts(self, ep: Comm) -> None:
        """Expert parallelism that splits the weights (parallel/expert_parallel/experts.py): this strategy's group is the experts'
        replicas, and the slices (WholeModel.slices, summed over `ep` in norms) are this rank's experts. Each
        step's averaged gradient is then settled (_settle_experts) before anything reads it."""
        self._ep = ep

    @torch.no_grad()
    def _settle_experts(self, local: torch.Tensor) -> None:
        """The gradient averaged over the replicas becomes the average over every rank: the dense parameters'
        (each rank of an ep group saw other tokens) summed over the ep group, and everything divided by ep (an
        expert's already holds the tokens of its whole ep group, sent to it). Collective over ep."""
        experts = self.flat.local_ranges(self._tp_sharded, self.shard_ranges)
        dense, at = [], 0
        for a, b in [*experts, (local.numel(), local.numel())]:
            if a > at:
                dense.append((at, a))
            at = b
        if dense:
            summed = torch.cat([local[a:b] for a, b in dense]).to(self._ep.device)  # local may be host-held
            self._ep.all_reduce_sum(summed)
            for (a, b), part in zip(dense, summed.split([b - a for a, b in dense])):
                local[a:b] = part  # (item assignment: local may be a PieceVector, ZeRO-2/3's shard)
        local.div_(self._ep.world_size)

    def _average(self, summed: torch.Tensor) -> torch.Tensor:
        """summed / the data-parallel ranks, in place. One rank's sum is left as it is: dividing by 1 changes no
        bit, and on one GPU the pass over the whole gradient is time the plain loop does not spend."""
        return summed if self.comm.world_size == 1 else summed.div_(self.comm.world_size)

    def _synced_grad(self) -> torch.Tensor:
        """_averaged_grad(), settled once per step under expert parallelism."""
        grad = self._averaged_grad()
        if self._ep is not None and not self._settled:
            self._settle_experts(grad)
            self._settled = True
        return grad

    def _sum_sq_parts(self, local: torch.Tensor, ranges: Ranges) -> torch.Tensor:
        """[squares of this rank's tensor-parallel slices, squares of everything else] of a local vector
        taken from `ranges`, in float64 (no tensor parallelism: [0, everything])."""
        square_sums = SquareSums()  # its float64 buffer lives as long as this norm's computation
        if self.tp.world_size == 1:
            return torch.cat([torch.zeros(1, dtype=torch.float64, device=local.device), square_sums(local).reshape(1)])
        sharded = self.flat.local_ranges(self._tp_sharded, ranges)
        in_slices = sum((square_sums(local[a:b]) for a, b in sharded),
                        torch.zeros((), dtype=torch.float64, device=local.device))
        rest, at = torch.zeros((), dtype=torch.float64, device=local.device), 0
        for a, b in [*sharded, (local.numel(), local.numel())]:
            rest = rest + square_sums(local[at:a])
            at = b
        return torch.stack([in_slices, rest])

    def _total_sum_sq(self, parts: torch.Tensor) -> torch.Tensor:
        """The model's sum of squares from _sum_sq_parts (already summed over the data-parallel shards)."""
        total = parts[1]
        if self.tp.world_size > 1:
            in_slices = parts[:1].clone()
            self.tp.all_reduce_sum(in_slices)
            total = in_slices[0] + parts[1]
        if self.pp.world_size > 1:
            total = total.reshape(1).clone()
            self.pp.all_reduce_sum(total)
            total = total[0]
        return total

    # --- the gradients a ported DDP loop reads (visible_grads.py; user_loop, stages 0 and 1) -----------------
    def _sync_when_backward_ends(self, suspended) -> None:
        """Finish the sync in the autograd engine's end-of-backward callback, unless `suspended()` (no_sync)."""
        if self.pcfg.user_loop:
            self._backward_end = BackwardEndSync([self.flat.param(s) for s in self.flat.segments],
                                                 self._sync_again, suspended)
            self.hooks += self._backward_end.handles

    def _keep_grads_in_place(self) -> None:
        """A gradient autograd made afresh because p.grad had been set to None (model.zero_grad(), torch's default
        set_to_none) is copied into its place in the flat buffer, which p.grad then views again: torch's meaning
        (a fresh start for that gradient) kept, and the sync sees it. Registered before the sync's own hooks."""
        def keep(p, view):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

        for seg in self.flat.segments:
            if seg.numel:
                view = self.flat.grad[seg.offset:seg.offset + seg.numel].view(seg.shape)
                self._kept_in_place.append(self.flat.param(seg))
                self.hooks.append(self.flat.param(seg).register_post_accumulate_grad_hook(
                    lambda p, view=view: keep(p, view)))

    def _sync_again(self) -> None:
        self._synced = False  # a second backward before the step syncs its own gradients too, as DDP's does
        self.finish_grad_sync()

    def _show_averaged(self, averaged: torch.Tensor) -> None:
        """p.grad (views of flat.grad) hold the averaged gradient: a wider averaged copy is rounded into them; a
        fingerprint is taken where a change before step() could not be honoured."""
        if not self.pcfg.user_loop:
            return
        if averaged is not self.flat.grad:
            self.flat.grad.copy_(averaged)
        why = ("the model is split over tensor-parallel ranks" if self.tp.world_size > 1 else
               "the model is split over pipeline stages" if self.pp.world_size > 1 else
               "the optimizer steps on their sum in a wider dtype, not on p.grad" if averaged is not self.flat.grad
               else None)
        if why is not None:
            self._visible_guard = self._visible_guard or VisibleGradGuard(why)
            self._visible_guard.take(self.flat.grad)

    # --- the user's own model.load_state_dict / state_dict (user_loop) ---------------------------------------------
    def _follow_user_state_dict(self, model: nn.Module) -> None:
        self.hooks.append(model.register_load_state_dict_post_hook(lambda _m, _keys: self.params_loaded()))

    @torch.no_grad()
    def params_loaded(self) -> None:
        """New values were loaded into the parameters (model.load_state_dict after prepare): a master kept apart from
        them (ZeRO-2, mixed precision) is taken from them again, or the next step would bring the old values back."""
        if not self.master_is_params:
            self.optimizer.master.copy_(take(self.flat.data, self.shard_ranges))
            self._note_versions()

    # --- the user's in-place edits of parameters (user_loop) ------------------------------------------------------
    def _watch_in_place_edits(self) -> None:
        """Where the optimizer steps a master kept apart from the parameters (ZeRO-2, mixed precision, offload), a
        parameter edited in place between steps (`with torch.no_grad(): p.clamp_(...)`, torch.nn.init on a layer)
        would be overwritten by the next step's publication of the master: each step first takes such edits into
        the master (_take_in_place_edits). Every in-place op on a parameter counts up its version, which the
        strategy's own writes (through the flat buffer) do not: a changed version is the user's edit, found at the
        cost of reading one number per parameter. An edit through `p.data` counts up another tensor's version and
        is not seen. ZeRO-3 needs none of this: there a parameter's storage is freed between steps and an edit is
        refused (freed_params.py)."""
        if not self.master_is_params and self.stage < 3:
            self._edit_watch = [(seg, self.flat.param(seg)) for seg in self.flat.segments if seg.numel]
            self._note_versions()

    def _note_versions(self) -> None:
        self._versions = [p._version for _, p in self._edit_watch]

    @torch.no_grad()
    def _take_in_place_edits(self) -> None:
        """The parameters edited in place since the last step: their values into this rank's master (rounded
        values in mixed precision: the edit is what the parameter now holds)."""
        edited = [seg for (seg, p), seen in zip(self._edit_watch, self._versions) if p._version != seen]
        if not edited:
            return
        at = 0  # where each shard range starts in the master
        for a, b in self.shard_ranges:
            for seg in edited:
                lo, hi = max(a, seg.offset), min(b, seg.offset + seg.numel)
                if lo < hi:
                    self.optimizer.master[at + lo - a:at + hi - a].copy_(self.flat.data[lo:hi])
            at += b - a
        self._note_versions()

    def ranges_of(self, rank: int) -> Ranges:
        """Physical ranges whose optimizer state `rank` holds: everything, or its chunk of each unit."""
        if self.stage == 0:
            return [(0, self.flat.padded_numel)]
        return [u.chunk(rank, self.comm.world_size) for u in self.flat.units]

    def settle_for_save(self) -> None:
        """Before a checkpoint's state is read: a strategy whose state lives elsewhere (parameter servers) brings
        this rank's part of it here. Every rank calls it (collective in effect)."""

    def resumed_at(self, step: int) -> None:
        """After a checkpoint of `step` was loaded: a strategy whose state lives elsewhere sends it there."""

    def save_topology(self, topo):
        """The ranks a checkpoint is saved over, after settle_for_save: all of `topo`'s (a parameter server's workers
        of which some have left: those still there)."""
        return topo

    def zero_grad(self, release: bool = False) -> None:
        """Zero the gradients for the next step. release: also give back the memory of gradients kept only
        between steps where the strategy can (ZeRO-2/3's shard), as torch's zero_grad(set_to_none=True) does."""
        self._end_abandoned_step()
        if release and self._kept_in_place:
            # torch's set_to_none: p.grad is None until the next backward, whose fresh gradient the hook above copies
            # into the buffer. One copy per gradient, where a zero-filled buffer costs a fill and an add (ZeRO-0 went
            # from 1.01 to 0.96 of DDP's step in benchmarks/prepare_vs_peers.py). A parameter that then gets no
            # gradient is zeroed before the sync (flat.grads_in_place), so the buffer's last step is never read as
            # this one's.
            self._drop_kept_grads()
            return
        self.flat.grad.zero_()

    def _end_abandoned_step(self) -> None:
        """Gradients cleared without a step (a loop that drops a batch whose norm it did not like: backward,
        clip_grad_norm_, zero_grad): the step's norm, settled gradient and sync state go with them, as after a
        step, so the next step computes its own (a kept norm was the dropped batch's, clipping the next one)."""
        self._settled = False
        self._norm = None
        self._forget_sync()

    def _forget_sync(self) -> None:
        """A step's gradient sync is over (the step was taken or abandoned): the next backward's is its own."""

    def _drop_kept_grads(self) -> None:
        for p in self._kept_in_place:
            p.grad = None

    def no_sync(self):
        """Context for all but the last micro-batch of a step: backward without gradient sync.
        Strategies that sync only inside step() need do nothing."""
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        """Complete this step's gradient sync (the trainer may call it early, to time it)."""

    # --- one update: subclasses say how gradients arrive and parameters leave ----------------
    def _averaged_grad(self) -> torch.Tensor:
        """This step's gradient, synced and averaged over the data-parallel ranks, over shard_ranges
        (local layout). Finishes the sync; the same tensor until the step ends."""
        raise NotImplementedError

    def _end_step(self) -> None:
        """Release this step's gradient (called after every step, skipped or not)."""

    def _publish_target(self) -> torch.Tensor | None:
        """Offloaded: the tensor the optimizer copies each chunk of the master into as soon as it has stepped it
        (its step's publish_to), so the copies to the device overlap the host's step; _publish goes on from there.
        None: _publish copies the master once the step is done (without offload nothing crosses a bus, and a
        target made before the step would stand beside the step's own buffers)."""
        return None

    def _publish(self, published: torch.Tensor | None) -> None:
        """Make the updated master the parameters every rank computes with; `published`: the _publish_target the
        optimizer has already copied it into, or None."""
        raise NotImplementedError

    def grad_norm(self, loss_scale: float = 1.0) -> float:
        """The global norm of this step's unscaled gradient (every rank, every shard, slice and stage;
        tied weights once): the same float on every rank. Finishes the gradient sync. Collective."""
        return float(self._grad_norm(loss_scale))

    def _grad_norm(self, loss_scale: float) -> torch.Tensor:
        """grad_norm as a float64 tensor on the device, computed once per step (nothing read back)."""
        if self._norm is None:
            self._norm = self._grad_norm_tensor(loss_scale)
        return self._norm

    def _grad_norm_tensor(self, loss_scale: float) -> torch.Tensor:
        """grad_norm as a float64 tensor on the device (collective; nothing read back)."""
        if self.closed:  # every update passes here: without its hooks, backward no longer syncs the gradients
            raise RuntimeError(f"this {self.name} strategy was closed (its hooks are off the model); prepare the "
                               "model again to train it")
        # On the group's device (an offloaded gradient shard is in host memory).
        parts = self._sum_sq_parts(self._synced_grad(), self.shard_ranges).to(self.comm.device)
        if self.stage >= 1:
            self.comm.all_reduce_sum(parts)  # over the data-parallel shards
        return self._total_sum_sq(parts).sqrt() / loss_scale

    @torch.no_grad()
    def unscale_grads(self, scale: float) -> None:
        """Divide this step's synced gradient by fp16's loss scale in place (torch.amp.GradScaler.unscale_); the
        step then runs with loss_scale=1. A power of two: no bit of a finite gradient changes but its exponent.
        Finishes the sync (collective where it is)."""
        self.finish_grad_sync()
        if self.stage <= 1 and self.pcfg.user_loop:  # the whole averaged gradient p.grad shows
            whole = self.to_reduce.tensor()
            whole.div_(scale)
            self._show_averaged(whole)
        else:
            self._synced_grad().div_(scale)

    @property
    def steps_on_device(self) -> bool:
        """Whether the optimizer skips a non-finite step by itself on the device (FlatAdamW's fused kernel), so that
        step() need not read the gradient norm on the host."""
        return getattr(self.optimizer, "skips_on_device", False)

    @torch.no_grad()
    def step(self, lr: float | None = None, loss_scale: float = 1.0, max_norm: float | None = None) -> torch.Tensor:
        """Sync gradients, clip, update parameters on every rank; return the global gradient norm as a float64
        tensor on the device. The gradients are of loss * loss_scale (fp16 loss scaling); the norm returned and the
        update are of the unscaled loss. max_norm: clip to it (default: the config's grad_clip). lr: the learning
        rate, or None to keep the optimizer's own. A non-finite norm (NaN/Inf in any rank's gradients, or an fp16
        overflow) skips the update on every rank: decided on the device where the optimizer can (steps_on_device;
        the host then reads the norm whenever it likes, with the step's other statistics), else on the host, which
        reads the norm here (every rank reads the same norm, so every rank decides alike)."""
        try:
            if self._visible_guard is not None:
                self.finish_grad_sync()
                self._visible_guard.check(self.flat.grad)
            norm = self._grad_norm(loss_scale)
            self._take_in_place_edits()
            clip = self.pcfg.grad_clip if max_norm is None else max_norm
            if self.steps_on_device:
                self._update(lr, clip_coefficient_tensor(norm, clip) / loss_scale,
                             found_inf=(~torch.isfinite(norm)).to(torch.float32))
            elif math.isfinite(value := float(norm)):
                self._update(lr, clip_coefficient(value, clip) / loss_scale)
            # else skip: parameters and optimizer state unchanged
        finally:
            self._settled = False  # however the step ends: the next gradient is settled afresh
        self._norm = None
        self._end_step()
        return norm

    def _update(self, lr: float | None, scale, found_inf: torch.Tensor | None = None) -> None:
        """The optimizer's step on this rank's shard of the gradient times `scale`, then the new parameters published
        (a step found_inf skips publishes the unchanged master: the same parameters)."""
        target = self._publish_target()
        kwargs = {} if found_inf is None else {"found_inf": found_inf}
        self.optimizer.step(self._synced_grad(), lr, scale, publish_to=target, **kwargs)
        self._publish(target)
        self.optimizer.release_pages()

    # --- what this rank holds --------------------------------------------------------
    def held_params(self) -> torch.Tensor:
        """The parameter tensor this rank keeps between steps (full, or its shard at ZeRO-3)."""
        return self.flat.data

    def held_grads(self) -> torch.Tensor | None:
        """The gradient tensor this rank keeps between steps (None if only transient)."""
        return self.flat.grad

    def full_params(self) -> torch.Tensor:
        """Every parameter, unpadded, in registration order (collective at ZeRO-3)."""
        return self.flat.to_logical(self.flat.data)

    def param_norm(self) -> float:
        """The global parameter norm (every shard, slice and stage): the same float on every rank."""
        return float(self.param_norm_tensor())

    def param_norm_tensor(self) -> torch.Tensor:
        """param_norm as a float64 tensor on the device (read it when convenient: reading it waits for it)."""
        return self._total_sum_sq(self._sum_sq_parts(self.flat.data, [(0, self.flat.padded_numel)])).sqrt()

    # --- memory ------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes held at rest, measured from the tensors' storages."""
        params, grads = self.held_params().untyped_storage(), self.held_grads()
        state = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self.optimizer.held_tensors()}
        state = list(state.values())
        return {"params": params.nbytes(),
                "grads": 0 if grads is None else held_bytes(grads),
                # A storage shared with the parameters is counted once, as parameters.
                "optimizer": sum(t.nbytes() for t in state if t.data_ptr() != params.data_ptr())}

    def peak_memory_bytes(self) -> dict[str, int]:
        """Most bytes of each kind held at any moment since the last reset_peak (at rest + transient)."""
        rest = self.memory_bytes()
        peak = {k: rest[k] + self.ledger.peak_transient[k] for k in MEMORY_KINDS}
        peak["total"] = sum(rest.values()) + self.ledger.peak_total_transient
        return peak

    def _memory_terms(self) -> dict[str, tuple[int, int]]:
        return memory_terms(self.stage, self.master_is_params, self.optimizer.elementwise_states())

    def element_sizes(self) -> dict[str, int]:
        """Bytes per element of each kind: the parameters' dtype, the gradient tensor kept between
        steps (the reduce dtype at ZeRO-2/3), the optimizer's master dtype."""
        grads = self.held_grads()
        return {"params": self.flat.element_size,
                "grads": self.flat.element_size if grads is None else grads.element_size(),
                "optimizer": self.optimizer.master.element_size()}

    def expected_memory_bytes(self) -> dict[str, int]:
        """Bytes at rest by the memory math: P = padded params, N = ranks, E = bytes per element."""
        elem, P, N = self.element_sizes(), self.flat.padded_numel, self.comm.world_size
        return {kind: term_bytes(terms, elem[kind], P, P // N) for kind, terms in self._memory_terms().items()}

    def memory_formula(self) -> dict[str, str]:
        """expected_memory_bytes() as text in bytes per parameter, e.g. {"optimizer": "12*P/N", ...}
        (float32: 3 tensors of 4 bytes)."""
        elem = self.element_sizes()
        return {kind: term_formula(terms, elem[kind]) for kind, terms in self._memory_terms().items()}

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of everything this rank holds that a resume must reproduce: its parameters
        and its optimizer state, keyed like the checkpoint."""
        state = {"params": self.held_params().clone()}
        state.update({f"optim.{k}": v.clone() for k, v in self.optimizer.state_tensors().items()})
        return state

    # --- checkpoint state ----------------------------------------------------------
    def checkpoint_ranges(self, rank: int) -> Ranges:
        """Physical ranges whose parameters and optimizer state `rank` writes to a checkpoint.
        Replicated state is written once, by rank 0."""
        if self.stage >= 1 or rank == 0:
            return self.ranges_of(rank)
        return []

    def local_params(self) -> torch.Tensor:
        """This rank's parameters over its shard ranges (local layout, like the optimizer's)."""
        return take(self.flat.data, self.shard_ranges)

    def state_pieces(self) -> dict[str, list[torch.Tensor]]:
        """What this rank's checkpoint file holds, as views of the live tensors, in local layout: each key's pieces
        laid end to end are its vector (the parameters over the shard ranges, the optimizer's state). Nothing is
        copied here: a snapshot copies the pieces straight into host memory (checkpoint/writing.py)."""
        if not self.checkpoint_ranges(self.comm.rank):
            return {}
        pieces = {"params": self._param_pieces()}
        pieces.update({f"optim.{k}": [t] for k, t in self.optimizer.state_tensors().items()})
        return pieces

    def _param_pieces(self) -> list[torch.Tensor]:
        return [self.flat.data[a:b] for a, b in self.shard_ranges]

    def _load_params(self, local: torch.Tensor) -> None:
        """This rank's parameters from `local` (over shard_ranges: everything, at data parallel)."""
        for (a, b), view in zip(self.shard_ranges, local_views(local, self.shard_ranges)):
            self.flat.data[a:b].copy_(view)

    @torch.no_grad()
    def load_local(self, params: torch.Tensor, optimizer_state: Mapping[str, torch.Tensor], scalars: dict) -> None:
        """Restore from this rank's own local vectors (over shard_ranges): its parameters, the optimizer's state by
        name (master, exp_avg, ...; a checkpoint's are read as the optimizer asks for them) and scalar state.
        Collective at ZeRO-1/2 (the parameters are gathered)."""
        self._load_params(params)
        self.optimizer.load_state(optimizer_state, scalars)
