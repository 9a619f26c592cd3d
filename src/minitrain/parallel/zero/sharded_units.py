"""Parameters sharded and gathered unit by unit: ZeRO-3, and ZeRO-2 whose units are freed after backward. One
flag tells them apart, as FSDP2's `reshard_after_forward` does.

Between steps a rank holds only its chunk of every unit's parameters (P/N elements). Hooks make each unit
(core/units.py: one per block) whole exactly when it is needed:

  forward:   pre-hook   all_gather the unit (and start gathering the next one, --prefetch); its parameters
                        point into the buffer
             post-hook  reshard_after_forward: free the buffer; hook the unit's output so that ...
  backward:  ... when the output's gradient is ready (the unit's backward is next), gather the unit again
                        if it was freed (and prefetch the one before it)
             when the unit's last gradient lands: reduce_scatter it into the gradient shard
                        (gradient_shard.py) and free the buffer.
  step's end: ZeRO-3 gathers nothing (the next forward does); ZeRO-2 gathers every unit from the updated shard,
             so the parameters are whole between steps.

ZeRO-2 (reshard_after_forward=False) is FSDP's SHARD_GRAD_OP: from its reduction to the end of the update a
unit's full parameters are dead, so they are freed there rather than kept whole as zero2.py keeps them, which
lowers the peak at the end of backward (docs/zero.md). It gathers from the shard, which in full precision is the
optimizer's master itself (make_strategy uses zero2.py otherwise). With gradient accumulation a unit freed by one
micro-batch's backward is gathered again by the next forward, as FSDP2 does.

Each unit has one gathered buffer whose *storage* is allocated only while the unit is whole (resized to 0 bytes
otherwise, FSDP's technique). The parameters are permanent views into it. That matters because autograd saves
views of the weights (a linear layer keeps W.t() for backward): freeing by dropping the buffer would leave those
views holding the memory until backward. Freeing the storage releases it; re-gathering into the same storage
before the unit's backward gives the saved views their values back. Writes go through the buffer tensor, whose
version counter is not the parameters', so autograd does not mistake the re-gather for an in-place change. The
optimizer updates the parameter shard in place (it is the master; in mixed precision the 16-bit shard is a
rounded copy of it).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...runtime.arrival import arrive
from ...runtime.comm import Comm, PendingCollective
from ..core.config import ParallelConfig
from ..core.piece_vector import PieceVector
from ..core.strategy import OptimizerFactory
from ..core.units import tensors_in
from ..core.flat_parameters import local_views, missing_gradients, take
from ..core.offload import copy_converting_on_device
from .sharded import ShardedStrategy


class ShardedUnits(ShardedStrategy):
    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 reshard_after_forward: bool = True, **kwargs):
        self.reshard_after_forward = reshard_after_forward
        self.stage = 3 if reshard_after_forward else 2
        self.name = f"zero{self.stage}"
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        self.prefetch = pcfg.prefetch
        # In full precision the parameter shard *is* the optimizer's master: both would hold the
        # same numbers, and nothing else needs them between steps (FSDP keeps one copy too). In
        # mixed precision the shard is 16-bit, a rounded copy of the float32 master.
        # (Not when the optimizer keeps its master on another device: offloaded to the host.)
        master = self.optimizer.master
        self.master_is_params = master.dtype == self.flat.dtype and master.device == self.flat.data.device
        self.param_shard = self.optimizer.master if self.master_is_params else take(self.flat.data, self.shard_ranges)
        self._param_views = local_views(self.param_shard, self.shard_ranges)
        self._buffers_whole = [self.param_shard.new_empty(u.stop - u.start) for u in self.flat.units]
        self._gathered: set[int] = set()
        self._gathering: dict[int, PendingCollective] = {}
        self.flat.data = None  # the full parameters exist only unit by unit from now on
        for i, unit in enumerate(self.flat.units):
            buffer = self._buffers_whole[i]
            for seg in unit.segments:
                self.flat.param(seg).data = buffer[seg.offset - unit.start:seg.offset - unit.start + seg.numel].view(
                    seg.shape)
            buffer.untyped_storage().resize_(0)
        self._order = [i for i, plan in enumerate(self.plans) if plan.module is not None]  # forward order
        self._shared = [i for i, plan in enumerate(self.plans) if plan.module is None]
        self._pinned: set[int] = set()  # gathered for a use outside their module: whole until their gradient is reduced
        for pos, i in enumerate(self._order):
            module = self.plans[i].module
            self.hooks.append(module.register_forward_pre_hook(
                self._eager(lambda _m, _args, pos=pos: self._before_forward(pos))))
            self.hooks.append(module.register_forward_hook(
                self._eager(lambda _m, _args, out, pos=pos: self._after_forward(pos, out))))
        self.hooks.append(model.register_forward_pre_hook(self._eager(self._before_model_forward)))
        self.hooks.append(model.register_forward_hook(self._eager(self._after_model_forward)))
        if pcfg.user_loop:
            unit_of = {id(self.flat.param(seg)): i for i, unit in enumerate(self.flat.units) for seg in unit.segments}
            self.hooks += self.loop.watch_uses(model, unit_of, lambda i: i in self._gathered, self._use_outside)
            # The user's code between steps reads a freed parameter by mistake: refused, not read (freed_params.py).
            self.loop.guard_freed([self.flat.param(seg) for seg in self.flat.segments])
        if not reshard_after_forward:
            assert self.master_is_params, "ZeRO-2 gathers its units from the master: see make_strategy"
            self._gather_all()

    @staticmethod
    def frees_after_backward(model: nn.Module, pcfg: ParallelConfig) -> bool:
        """Whether ZeRO-2 can free each unit after backward (see the module docstring): full precision on the
        device, in the trainer's own loop."""
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        return not pcfg.user_loop and pcfg.offload == "none" and dtypes == {pcfg.master_dtype}

    def _set_down(self, i: int) -> None:
        """Unit i is not needed until its backward (or the next forward): ZeRO-3 frees it; ZeRO-2 keeps it until its
        gradient is reduced."""
        if self.reshard_after_forward:
            self._free(i)

    def _follow_user_state_dict(self, model: nn.Module) -> None:
        """model.load_state_dict gathers every unit first and keeps this rank's chunks of the loaded values
        (collective: every rank loads, as every rank prepared); model.state_dict() is refused, its parameters
        being freed shards between steps."""
        super()._follow_user_state_dict(model)
        self.hooks.append(model.register_load_state_dict_pre_hook(self._before_user_load))
        self.hooks.append(model.register_state_dict_pre_hook(self._refuse_values))

    def _before_user_load(self, *_args) -> None:
        arrive(self.comm, "model.load_state_dict()", "at ZeRO-3 each rank holds a shard of the parameters, which "
               "model.load_state_dict() gathers from every rank: call it on every rank")
        for i in range(len(self.flat.units)):
            self._ensure(i)

    @torch.no_grad()
    def params_loaded(self) -> None:
        for i, unit in enumerate(self.flat.units):
            a, b = unit.chunk(self.comm.rank, self.comm.world_size)
            self._param_views[i].copy_(self._buffers_whole[i][a - unit.start:b - unit.start])
            self._free(i)
        if not self.master_is_params:
            self.optimizer.master.copy_(self.param_shard)

    @staticmethod
    def _refuse_values(_module, _prefix, keep_vars) -> None:
        if not keep_vars:
            raise RuntimeError("at ZeRO-3 a rank holds only shards of the parameters (the rest is freed between "
                               "steps), so model.state_dict() has no values to give: use "
                               "minitrain.full_state_dict(model) "
                               "(collective, the whole model on every rank) or minitrain.save_checkpoint")

    def _use_outside(self, i: int) -> None:
        """Unit i's parameter is used outside its module's forward: gather it, and keep it whole until its gradient
        is reduced (the user's backward reads it again) or, without a backward, until the forward ends."""
        self._ensure(i)
        self._pinned.add(i)

    # --- gather and free ----------------------------------------------------------------
    def _start_gather(self, i: int) -> None:
        if i in self._gathered or i in self._gathering:
            return
        buffer = self._buffers_whole[i]
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        if self.reshard_after_forward:  # a transient at ZeRO-3; ZeRO-2 holds its units at rest (memory_bytes)
            self.ledger.hold("params", buffer)
        self._gathering[i] = self.comm.all_gather_async(buffer, self._param_views[i])

    def _ensure(self, i: int) -> None:
        """Unit i's parameters gathered (waits for a prefetch in flight)."""
        if i not in self._gathered:
            self._start_gather(i)
            self._gathering.pop(i).wait()
            self._gathered.add(i)

    def _free(self, i: int) -> None:
        self._pinned.discard(i)
        if i in self._gathered:
            self._gathered.remove(i)
            buffer = self._buffers_whole[i]
            if self.reshard_after_forward:
                self.ledger.drop("params", buffer)
            buffer.untyped_storage().resize_(0)

    @torch.no_grad()
    def _gather_all(self) -> None:
        """Collective: every unit gathered afresh from the shards (a unit still whole has the values of before)."""
        for i in list(self._gathering):  # a prefetch in flight read the shard before it changed
            self._ensure(i)
        self._gathered.clear()
        for i in range(len(self.flat.units)):
            self._start_gather(i)
        for i in list(self._gathering):
            self._ensure(i)

    def _whole(self) -> bool:
        """ZeRO-2 between steps: every unit gathered, read where it is."""
        return not self.reshard_after_forward and len(self._gathered) == len(self.flat.units)

    # --- hooks ----------------------------------------------------------------------------
    def _before_model_forward(self, _model, _args) -> None:
        if self.stage == 3 and self.pcfg.user_loop and not torch.is_grad_enabled():
            # An evaluation, which a DDP script runs on rank 0 alone: its gathers would pair with the other ranks'
            # training collectives (runtime/arrival.py). A training forward announces nothing (it costs nothing):
            # a rank alone in one waits in its first gather, where a rank arriving here finds it.
            arrive(self.comm, "the model's forward", "at ZeRO-3 each rank holds a shard of the parameters, which "
                   "every forward gathers from every rank: run the model on every rank (an evaluation too), and use "
                   "the result on one")
        for i in self._shared:  # used by several units: whole from forward until its gradient is reduced
            self._ensure(i)

    def _after_model_forward(self, model, _args, output) -> None:
        if not torch.is_grad_enabled():  # no backward will come to free them
            for i in [*self._shared, *self._pinned]:
                self._set_down(i)
        elif self._shared:
            # Backward starts at the model's output: make sure the shared unit is whole then too
            # (a no-grad forward, or another backward, may have freed it since this forward).
            self._hook_outputs(output, self._before_model_backward, type(model).__name__)

    def _before_model_backward(self, _grad) -> None:
        for i in self._shared:
            self._ensure(i)

    def _hook_outputs(self, output, hook, who: str) -> None:
        # Every tensor in the output, however it is held (a Hugging Face ModelOutput is a dict, a block may return
        # a dataclass): the first gradient to reach any of them starts this unit's backward.
        found = False
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(hook)
                found = True
        if not found:
            frozen = [seg.name for seg in self.flat.segments if not self.flat.param(seg).requires_grad]
            if frozen:  # what prepare took to train, frozen since: nothing the unit computes needs a gradient
                raise RuntimeError(missing_gradients(frozen, self.flat, "ZeRO-3"))
            raise ValueError(f"ZeRO-3 finds no tensor that requires grad in what '{who}' returned (a "
                             f"{type(output).__name__}), so it cannot see its backward start to gather its parameters "
                             "again: return the tensors (a tuple, dict or dataclass of them), or use zero=2")

    def _before_forward(self, pos: int) -> None:
        for i in self._shared:  # a unit called on its own (from a loss), not through the model's forward
            self._ensure(i)
        self._ensure(self._order[pos])
        if self.prefetch and pos + 1 < len(self._order):
            self._start_gather(self._order[pos + 1])

    def _after_forward(self, pos: int, output) -> None:
        i = self._order[pos]
        if i not in self._pinned:
            self._set_down(i)
        if torch.is_grad_enabled():
            self._hook_outputs(output, lambda _grad, pos=pos: self._before_backward(pos), self.plans[i].name)

    def _before_backward(self, pos: int) -> None:
        self.grad_shard.retire_done()  # the last unit's full gradient, freed before this one's backward rather than during it
        self._ensure(self._order[pos])
        if self.prefetch and pos > 0:
            self._start_gather(self._order[pos - 1])

    def _unit_reduced(self, i: int) -> None:
        self._free(i)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        super().finish_grad_sync()
        # A prefetch nobody used (its unit got no backward) must land before the optimizer
        # writes the shard it reads, and its buffer must not outlive the step.
        for i in list(self._gathering):
            self._ensure(i)
        for i in list(self._gathered):
            self._set_down(i)

    # --- what this rank holds ----------------------------------------------------------------
    def held_params(self) -> torch.Tensor:
        return self.param_shard

    def _param_pieces(self) -> list[torch.Tensor]:
        return [self.param_shard]

    def local_params(self) -> torch.Tensor:
        # A copy: the shard is also optim.master, and a checkpoint file stores each tensor's own bytes.
        return self.param_shard.clone()

    def full_params(self) -> torch.Tensor:
        """Collective: every rank gathers every unit (ZeRO-2 between steps reads its units: no collective)."""
        if self._whole():
            return self.flat.to_logical(torch.cat(self._buffers_whole))
        physical = self.param_shard.new_zeros(self.flat.padded_numel)
        for unit, view in zip(self.flat.units, self._param_views):
            self.comm.all_gather(physical[unit.start:unit.stop], view)
        return self.flat.to_logical(physical)

    def param_norm_tensor(self) -> torch.Tensor:
        """Collective: the shards' sums of squares, all-reduced (ZeRO-2 between steps: its units' squares)."""
        if self._whole():
            whole = PieceVector(self._buffers_whole)
            return self.split.total_sum_sq(self.split.sum_sq_parts(whole, [(0, self.flat.padded_numel)])).sqrt()
        parts = self.split.sum_sq_parts(self.param_shard, self.shard_ranges)
        self.comm.all_reduce_sum(parts)
        return self.split.total_sum_sq(parts).sqrt()

    def _load_params(self, local: torch.Tensor) -> None:
        self.param_shard.copy_(local)
        if not self.reshard_after_forward:
            self._gather_all()

    def _end_step(self) -> None:
        super()._end_step()
        if not self.reshard_after_forward:
            self._gather_all()  # from the shard, updated or (a skipped update: non-finite gradients) as it was

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        state = super().state_snapshot()
        if not self.reshard_after_forward:
            state["params"] = torch.cat(self._buffers_whole)  # what it holds between steps, as zero2.py does
        return state

    def memory_bytes(self) -> dict[str, int]:
        held = super().memory_bytes()  # the shard (with the optimizer's state)
        if not self.reshard_after_forward:  # whole between steps
            held["params"] += sum(b.numel() * b.element_size() for b in self._buffers_whole)
        return held

    def _publish_target(self) -> torch.Tensor | None:
        return self.param_shard if self.pcfg.offload != "none" and not self.master_is_params else None

    def _publish(self, published: torch.Tensor | None) -> None:
        """Full precision: nothing to do, the optimizer updated the parameter shard in place.
        Mixed, or offloaded: round the master into the 16-bit shard (gathered unit by unit at the next forward),
        unless the optimizer has already."""
        if published is None and not self.master_is_params:
            copy_converting_on_device(self.param_shard, self.optimizer.master)
