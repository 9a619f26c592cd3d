"""ZeRO-3: parameters sharded at rest too; each unit is gathered only while it computes.

Between steps a rank holds only its chunk of every unit's parameters
(P/N elements), and every model parameter points at an empty tensor. Hooks
make each unit (units.py: one per block) whole exactly when it is needed:

  forward:   pre-hook   all_gather the unit (and start gathering the next one,
                        --prefetch); point its parameters into the buffer
             post-hook  free the buffer; hook the unit's output so that ...
  backward:  ... when the output's gradient is ready (the unit's backward is
                        next), gather the unit again (and prefetch the one
                        before it)
             when the unit's last gradient lands: reduce_scatter it into the
                        gradient shard (ZeRO-2's path) and free the buffer.

Autograd keeps the parameter *objects* it saved in forward; re-pointing their
.data at a freshly gathered buffer before the unit's backward gives backward
the same values (FSDP's approach). After the optimizer step the updated master
shard is copied into the parameter shard; nothing is gathered until the next
forward.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm, PendingCollective
from ..config import TrainConfig
from .flat import local_views, take
from .zero import Zero2


class Zero3(Zero2):
    name = "zero3"
    stage = 3

    def __init__(self, model: nn.Module, comm: Comm, cfg: TrainConfig, prefetch: bool = True):
        super().__init__(model, comm, cfg)
        self.prefetch = prefetch
        self.param_shard = self.local_params()
        self._param_views = local_views(self.param_shard, self.shard_ranges)
        self._empty = self.param_shard.new_empty(0)
        self._gathered: dict[int, torch.Tensor] = {}
        self._gathering: dict[int, tuple[PendingCollective, torch.Tensor]] = {}
        self.flat.data = None  # the full parameters exist only unit by unit from now on
        for i in range(len(self.flat.units)):
            self._point_at(i, None)
        self._order = [i for i, plan in enumerate(self.plans) if plan.module is not None]  # forward order
        self._shared = [i for i, plan in enumerate(self.plans) if plan.module is None]
        for pos, i in enumerate(self._order):
            self.plans[i].module.register_forward_pre_hook(lambda _m, _args, pos=pos: self._before_forward(pos))
            self.plans[i].module.register_forward_hook(lambda _m, _args, out, pos=pos: self._after_forward(pos, out))
        model.register_forward_pre_hook(self._before_model_forward)
        model.register_forward_hook(self._after_model_forward)

    # --- gather and free ----------------------------------------------------------------
    def _point_at(self, i: int, buffer: torch.Tensor | None) -> None:
        unit = self.flat.units[i]
        for seg in unit.segments:
            p = self.flat.param(seg)
            p.data = self._empty if buffer is None else \
                buffer[seg.offset - unit.start:seg.offset - unit.start + seg.numel].view(seg.shape)

    def _start_gather(self, i: int) -> None:
        if i in self._gathered or i in self._gathering:
            return
        unit = self.flat.units[i]
        buffer = self.param_shard.new_empty(unit.stop - unit.start)
        self.ledger.hold("params", buffer)
        self._gathering[i] = (self.comm.all_gather_async(buffer, self._param_views[i]), buffer)

    def _ensure(self, i: int) -> None:
        """Unit i's parameters gathered and in place (waits for a prefetch in flight)."""
        if i in self._gathered:
            return
        self._start_gather(i)
        pending, buffer = self._gathering.pop(i)
        pending.wait()
        self._gathered[i] = buffer
        self._point_at(i, buffer)

    def _free(self, i: int) -> None:
        buffer = self._gathered.pop(i, None)
        if buffer is not None:
            self._point_at(i, None)
            self.ledger.drop("params", buffer)

    # --- hooks ----------------------------------------------------------------------------
    def _before_model_forward(self, _model, _args) -> None:
        for i in self._shared:  # used by several units: whole from forward until its gradient is reduced
            self._ensure(i)

    def _after_model_forward(self, _model, _args, _output) -> None:
        if not torch.is_grad_enabled():  # no backward will come to free them
            for i in self._shared:
                self._free(i)

    def _before_forward(self, pos: int) -> None:
        self._ensure(self._order[pos])
        if self.prefetch and pos + 1 < len(self._order):
            self._start_gather(self._order[pos + 1])

    def _after_forward(self, pos: int, output) -> None:
        i = self._order[pos]
        self._free(i)
        if torch.is_grad_enabled():
            for t in output if isinstance(output, (tuple, list)) else (output,):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _grad, pos=pos: self._before_backward(pos))

    def _before_backward(self, pos: int) -> None:
        self._ensure(self._order[pos])
        if self.prefetch and pos > 0:
            self._start_gather(self._order[pos - 1])

    def _unit_reduced(self, i: int) -> None:
        self._free(i)

    # --- what this rank holds ----------------------------------------------------------------
    def held_params(self) -> torch.Tensor:
        return self.param_shard

    def local_params(self) -> torch.Tensor:
        if self.flat.data is None:
            return self.param_shard
        return take(self.flat.data, self.shard_ranges)

    def full_params(self) -> torch.Tensor:
        """Collective: every rank gathers every unit."""
        physical = self.param_shard.new_zeros(self.flat.padded_numel)
        for unit, view in zip(self.flat.units, self._param_views):
            self.comm.all_gather(physical[unit.start:unit.stop], view)
        return self.flat.to_logical(physical)

    def param_norm(self) -> float:
        """Collective: the shards' sums of squares, all-reduced."""
        sum_sq = self.param_shard.double().square().sum().reshape(1)
        self.comm.all_reduce_sum(sum_sq)
        return float(sum_sq.sqrt())

    def _load_params(self, physical: torch.Tensor) -> None:
        self.param_shard.copy_(take(physical, self.shard_ranges))

    def _publish(self) -> None:
        self.param_shard.copy_(self.optimizer.master)
