"""The base of every data-parallel strategy: flat buffers (flat_parameters.py), a shard optimizer, the global
gradient norm and clipping, what a rank holds, and its checkpoint state.

`stage` says what is sharded across ranks, as in the ZeRO paper: 0 nothing, 1 optimizer state, 2 also gradients,
3 also parameters. The optimizer is built by a factory the caller passes (`make_optimizer(master, flat,
shard_ranges)`): minitrain's own `FlatAdamW` for the CLI, or a user's torch optimizer over this rank's shard
(`shard_optimizer.py`), so the strategies never know which.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn

from ...runtime.comm import Comm
from .config import ParallelConfig
from .in_place_edits import InPlaceEdits
from .flat_parameters import FlatParameters, Ranges, WholeModel, local_views, take
from .memory_math import MEMORY_KINDS, MemoryLedger, memory_terms, term_bytes, term_formula
from .model_split import ModelSplit
from .norms import clip_coefficient, clip_coefficient_tensor
from .sync_stats import sync_figures
from .piece_vector import held_bytes
from ..state.placement import Placement, placements

# (master, flat parameters, this rank's shard ranges) -> an optimizer over the shard (see FlatStrategy)
OptimizerFactory = Callable[[torch.Tensor, FlatParameters, Ranges], object]


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
                 whole: WholeModel | None = None, loop=None):
        self.model, self.comm, self.pcfg = model, comm, pcfg
        if pcfg.user_loop and loop is None:
            raise ValueError("a strategy for a user's own loop needs the loop's mechanisms: make it with make_strategy")
        self.loop = loop  # what a user's own loop needs, handed in from above (user_loop/support.py); None in the CLI
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
        # values).
        self.sum_dtype = self.flat.dtype if comm.alone else pcfg.reduce_dtype
        # The groups the model is split across besides this one (tensor, pipeline, expert parallel): the norms and,
        # under expert parallelism, the gradient must cover them (model_split.py).
        self.split = ModelSplit(self.flat, comm.device)
        self._norm: torch.Tensor | None = None  # this step's global gradient norm, once computed
        # Every hook this strategy puts on the model or its parameters: close() removes them, so a dropped model no
        # longer reaches the strategy (autograd would keep both alive) and the model is the user's own again.
        self.hooks: list = []
        self.closed = False  # close() was called: no further update (its gradients would no longer be synced)
        # No further step can be taken (parameter servers that another worker has left): the run stops.
        self.ending = False
        # What a user's loop sees in p.grad at ZeRO-0/1, views of the flat gradient (user_loop/visible_grads.py).
        self.visible = None
        # A user's in-place edits of parameters the optimizer does not step directly (in_place_edits.py).
        self._edits: InPlaceEdits | None = None
        if pcfg.user_loop:
            self._follow_user_state_dict(model)
            # ZeRO-3 needs none: there a parameter's storage is freed between steps and an edit is refused.
            if not self.master_is_params and self.stage < 3:
                self._edits = InPlaceEdits(self.flat, self.shard_ranges, self.optimizer)
            if self.flat.grad is not None:
                self.visible = loop.visible_gradients(self.flat)
                self.hooks += self.visible.handles

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
        self.split.use_groups(tp, pp)

    def use_experts(self, ep: Comm) -> None:
        """Expert parallelism (expert_parallel/experts.py): this strategy's group is the experts' replicas, the slices
        (summed over `ep` in norms) this rank's experts; the averaged gradient is settled before it is read."""
        self.split.ep = ep

    def _average(self, summed: torch.Tensor) -> torch.Tensor:
        """summed / the data-parallel ranks, in place. One rank's sum is left as it is: dividing by 1 changes no
        bit, and on one GPU the pass over the whole gradient is time the plain loop does not spend."""
        return summed if self.comm.world_size == 1 else summed.div_(self.comm.world_size)

    def _synced_grad(self) -> torch.Tensor:
        """_averaged_grad(), settled once per step under expert parallelism."""
        grad = self._averaged_grad()
        self.split.settle_once(grad, self.shard_ranges)
        return grad

    # --- the gradients a ported DDP loop reads (user_loop, stages 0 and 1: user_loop/visible_grads.py) ----------
    def _sync_when_backward_ends(self, suspended) -> None:
        """Finish the sync in the autograd engine's end-of-backward callback, unless `suspended()` (no_sync)."""
        if self.visible is not None:
            self.hooks += self.visible.sync_when_backward_ends(self._sync_again, suspended)

    def _sync_again(self) -> None:
        self._synced = False  # a second backward before the step syncs its own gradients too, as DDP's does
        self.finish_grad_sync()

    def _show_averaged(self, averaged: torch.Tensor) -> None:
        """p.grad (views of flat.grad) hold the averaged gradient (a user's loop), under ep settled first: whole."""
        if self.visible is not None:
            self.split.settle_once(averaged, [(0, averaged.numel())])  # (the optimizer's shard is a view of it)
            self.visible.show(averaged, self.split.tp.world_size > 1, self.split.pp.world_size > 1)

    # --- the user's own model.load_state_dict / state_dict (user_loop) ---------------------------------------------
    def _follow_user_state_dict(self, model: nn.Module) -> None:
        self.hooks.append(model.register_load_state_dict_post_hook(lambda _m, _keys: self.params_loaded()))

    @torch.no_grad()
    def params_loaded(self) -> None:
        """New values were loaded into the parameters (model.load_state_dict after prepare): a master kept apart from
        them (ZeRO-2, mixed precision) is taken from them again, or the next step would bring the old values back."""
        if not self.master_is_params:
            self.optimizer.master.copy_(take(self.flat.data, self.shard_ranges))
            if self._edits is not None:
                self._edits.note()

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
        if release and self.visible is not None:
            # torch's set_to_none: p.grad is None until the next backward, whose fresh gradient is copied into the
            # buffer (VisibleGradients). One copy per gradient, where a zero-filled buffer costs a fill and an add.
            # A parameter that then gets no gradient is zeroed before the sync (flat.grads_in_place), so the
            # buffer's last step is never read as this one's.
            self.visible.drop()
            return
        self.flat.grad.zero_()

    def _end_abandoned_step(self) -> None:
        """Gradients cleared without a step (a loop that drops a batch whose norm it did not like: backward,
        clip_grad_norm_, zero_grad): the step's norm, settled gradient and sync state go with them, as after a
        step, so the next step computes its own (a kept norm was the dropped batch's, clipping the next one)."""
        self.split.settled = False
        self._norm = None
        self._forget_sync()

    def _forget_sync(self) -> None:
        """A step's gradient sync is over (the step was taken or abandoned): the next backward's is its own."""

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
        parts = self.split.sum_sq_parts(self._synced_grad(), self.shard_ranges).to(self.comm.device)
        if self.stage >= 1:
            self.comm.all_reduce_sum(parts)  # over the data-parallel shards
        return self.split.total_sum_sq(parts).sqrt() / loss_scale

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
            if self.visible is not None and self.visible.guard is not None:
                self.finish_grad_sync()
                self.visible.guard.check(self.flat.grad)
            norm = self._grad_norm(loss_scale)
            if self._edits is not None:
                self._edits.take()
            clip = self.pcfg.grad_clip if max_norm is None else max_norm
            if self.steps_on_device:
                self._update(lr, clip_coefficient_tensor(norm, clip) / loss_scale,
                             found_inf=(~torch.isfinite(norm)).to(torch.float32))
            elif math.isfinite(value := float(norm)):
                self._update(lr, clip_coefficient(value, clip) / loss_scale)
            # else skip: parameters and optimizer state unchanged
        finally:
            self.split.settled = False  # however the step ends: the next gradient is settled afresh
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
        return self.split.total_sum_sq(self.split.sum_sq_parts(self.flat.data, [(0, self.flat.padded_numel)])).sqrt()

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
