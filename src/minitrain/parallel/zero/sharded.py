"""What ZeRO's three stages share (Rajbhandari et al., SC'20): the optimizer updates only this rank's shard.

Units (core/units.py: one per block, or the whole model at ZeRO-1) are padded to a multiple of N; rank r owns
the r-th chunk of every unit and keeps only those elements of the master weights and Adam's m and v: 12*P/N
bytes in float32 instead of 12*P. One step:
  1. this rank's shard of the summed gradient (each stage gets it its own way), divided by N;
  2. the global gradient norm: each rank's sum of squares, all-reduced;
  3. the optimizer on the shard (clipped);
  4. all_gather the updated chunks back into every rank's parameters (ZeRO-3: at the next forward, unit by unit).

Stages 2 and 3 keep no full gradient buffer: the gradient is reduce-scattered unit by unit while backward runs
(gradient_shard.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...runtime.comm import Comm
from ..core.config import ParallelConfig
from ..core.flat_parameters import local_views
from ..core.offload import copy_converting_on_device
from ..core.piece_vector import PieceVector
from ..core.strategy import FlatStrategy, OptimizerFactory
from ..core.units import module_units, unit_layout
from .gradient_shard import GradientShard


class ShardedStrategy(FlatStrategy):
    """Stages 1-3: the optimizer updates this rank's shard from the averaged gradient shard. At stages 2 and 3 the
    gradient shard is a GradientShard, filled while backward runs, and each block is a unit."""

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        self.plans = module_units(model) if self.stage >= 2 else None
        if self.plans is not None:
            kwargs.update(units=unit_layout(self.plans), keep_grad=False)
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        # The sync divides by N itself in a user's loop: ZeRO-1 its whole buffer, which p.grad shows; ZeRO-2/3 each
        # backward's reduced sum as it lands (GradientShard's `average`).
        self._averaged_in_sync = pcfg.user_loop
        self._grad: torch.Tensor | None = None  # this step's averaged gradient shard, once synced
        self.grad_shard: GradientShard | None = None
        if self.plans is not None:
            # What p.grad holds once its gradient is on its way to the shard: None, or for a loop that reads p.grad
            # a ShardedGradient that says so.
            placeholders = self.loop.sharded_gradients(self.flat, self.stage) if pcfg.user_loop else {}
            self.grad_shard = GradientShard(self.flat, comm, self.shard_ranges, self.reduce_dtype, self.ledger,
                                            offloaded=pcfg.offload != "none", stage=self.stage,
                                            placeholders=placeholders, average=self._averaged_in_sync,
                                            on_reduced=self._unit_reduced)
            self.hooks += self.grad_shard.handles
            # A new forward means the last backward is over: finish its reductions now, so with gradient
            # accumulation the last unit's full gradient does not sit through a forward.
            self.hooks.append(model.register_forward_pre_hook(
                self._eager(lambda _m, _args: self.grad_shard.retire_all())))

    def _eager(self, hook):
        """A hook of the model's that gathers, frees or waits on collectives, run as it is where a user compiles the
        model after prepare (torch.compile would trace it). Only in a user's loop: torch.compiler.disable imports
        torch.compile's machinery, which the CLI's processes need not pay for."""
        return torch.compiler.disable(hook) if self.pcfg.user_loop else hook

    def _unit_reduced(self, i: int) -> None:
        """Called once unit i's gradient reduction has started (ZeRO-3 frees its parameters)."""

    # --- the gradient shard (stages 2-3; ZeRO-1 overrides) -----------------------------------------------------
    def _gradient_shard(self) -> torch.Tensor | PieceVector:
        """This rank's summed (not yet averaged, unless _averaged_in_sync) gradient shard, once the sync is finished."""
        return self.grad_shard.tensor()

    def held_grads(self) -> torch.Tensor | PieceVector | None:
        return super().held_grads() if self.grad_shard is None else self.grad_shard.held()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        backward_end = self.comm.clock.mark()
        intervals = self.grad_shard.finish()
        if intervals:
            self.sync_at(len(self.flat.units), intervals, backward_end)

    def zero_grad(self, release: bool = False) -> None:
        if self.grad_shard is None:
            return super().zero_grad(release)
        self._end_abandoned_step()
        self.grad_shard.zero(release)

    # --- the update ---------------------------------------------------------------------------------------------
    def _averaged_grad(self) -> torch.Tensor:
        if self._grad is None:
            self.finish_grad_sync()
            self._grad = self._gradient_shard()
            if not self._averaged_in_sync:
                self._average(self._grad)
        return self._grad

    def _end_step(self) -> None:
        self._forget_sync()

    def _forget_sync(self) -> None:
        self._grad = None  # this step's averaged shard: the next step takes its own

    def _gathered_as_it_is(self) -> bool:
        """Whether the master is gathered from where it is, in its dtype (else through a copy on the device the
        collective runs on, in the parameters' dtype; an offloaded master is on the host)."""
        master, data = self.optimizer.master, self.flat.data
        return (master.dtype, master.device) == (data.dtype, data.device)

    def _gather_source(self) -> torch.Tensor:
        """A buffer for the master in the parameters' dtype, on the device the collective runs on (booked as
        parameters until _publish drops it)."""
        source = torch.empty(self.optimizer.master.numel(), dtype=self.flat.dtype, device=self.flat.data.device)
        self.ledger.hold("params", source)
        return source

    def _publish_target(self) -> torch.Tensor | None:
        if self.pcfg.offload == "none" or self._gathered_as_it_is():
            return None
        return self._gather_source()

    def _publish(self, published: torch.Tensor | None) -> None:
        """Make the updated master shard the parameters every rank computes with (in mixed
        precision, gathering the master rounded to the parameters' dtype: half the bytes).
        published: the master's copy the optimizer has made on the device (offloaded), gathered from."""
        master = self.optimizer.master  # at ZeRO-1 it may be this rank's chunk of flat.data: gathered in place
        source = published
        if source is None:
            source = master if self._gathered_as_it_is() else copy_converting_on_device(self._gather_source(), master)
        views = local_views(source, self.shard_ranges)
        pending = [self.comm.all_gather_async(self.flat.data[u.start:u.stop], view)
                   for u, view in zip(self.flat.units, views)]
        for p in pending:
            p.wait()
        if source is not master:
            self.ledger.drop("params", source)

    @torch.no_grad()
    def _load_params(self, local: torch.Tensor) -> None:
        """Every rank restores its own shard; the full parameters are gathered from them."""
        local = local.to(device=self.flat.data.device, dtype=self.flat.dtype)  # a checkpoint is read on the host
        for u, view in zip(self.flat.units, local_views(local, self.shard_ranges)):
            self.comm.all_gather(self.flat.data[u.start:u.stop], view)
