"""The optimizer prepare returns: the user's own optimizer class, running on this rank's shard of the flat
parameters, behind torch's Optimizer interface (param_groups, state, step, zero_grad, state_dict)."""
from __future__ import annotations

import torch

from ..parallel import FlatStrategy
from ..parallel.state.whole_state import full_optimizer_state, load_optimizer_state
from .session import Prepared, current, held_apart
from .steps import check_fed_alike


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, as prepare returns it: step() syncs what backward has not yet synced, clips
    when clip_grad_norm_ asked, updates this rank's shard with the user's optimizer and publishes the new
    parameters; zero_grad() clears the flat gradients. `param_groups` and `state` are the user's optimizer's
    (over this rank's shard), so learning-rate schedulers work on it. Its state is saved and loaded with
    minitrain.save_checkpoint / load_checkpoint (state_dict() of one rank's shard would not reshard)."""

    def __init__(self, strategy: FlatStrategy, prepared: Prepared,  # noqa: D107 - shares the inner optimizer's
                 inner: torch.optim.Optimizer | None = None):
        """inner: the user's optimizer whose param_groups this one shows (default: the one the strategy steps, whose
        param groups the user sees as the shard optimizer's `shown` ones, over the model's parameters; a
        parameter-server worker's steps on the servers, so it gives one of its own)."""
        self._strategy, self._prepared = strategy, prepared
        self.inner: torch.optim.Optimizer = inner if inner is not None else strategy.optimizer.inner
        self.param_groups = self.inner.param_groups if inner is not None else strategy.optimizer.shown
        self.defaults, self.state = self.inner.defaults, self.inner.state
        # A parameter-server worker's: each group's options as prepare made them. Only the learning rate goes with a
        # push, so any other option changed since (a scheduler cycling momentum) is refused at the next step.
        self._options = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in self.param_groups]
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        self._patch_step_function()  # torch's: step() runs the step hooks registered on this optimizer

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every rank's parameters (collective). A step whose gradients hold NaN/Inf on any rank
        is skipped on every rank (parameters and optimizer state unchanged). In fp16, step through the
        GradScaler instead (scaler.step(optimizer))."""
        if self._prepared.settings["precision"] == "fp16":
            raise RuntimeError("precision='fp16' steps through its loss scaler: scaler = "
                               "minitrain.GradScaler(optimizer), then scaler.scale(loss).backward(); "
                               "scaler.step(optimizer); scaler.update()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(1.0)
        return loss

    def _step(self, loss_scale: float) -> float:
        """The update from gradients of the loss times loss_scale; returns the (unscaled) global gradient norm,
        not finite if the step was skipped."""
        check_fed_alike(self._prepared)
        max_norm, self._prepared.max_norm = self._prepared.max_norm, None
        if self._prepared.settings["servers"]:
            pushed, self._prepared.pushed_norm = self._prepared.pushed_norm, None
            return pushed if pushed is not None else self.push(0.0)
        return float(self._strategy.step(None, loss_scale, max_norm if max_norm is not None else 0.0))

    def push(self, max_norm: float) -> float:
        """A parameter-server worker's update: its gradient to the servers with every param group's learning rate,
        clipped there to max_norm (0: not clipped); returns the global norm of the update pulled."""
        for i, (group, options) in enumerate(zip(self.param_groups, self._options)):
            changed = sorted(k for k, v in options.items() if group.get(k) != v)
            if changed:
                raise ValueError(f"param group {i}: {', '.join(changed)} changed since prepare; with parameter servers "
                                 "only the learning rate follows the worker's optimizer (a scheduler that cycles "
                                 "momentum, such as OneCycleLR, needs cycle_momentum=False)")
        norm = float(self._strategy.step(None, 1.0, max_norm, group_lrs=[group["lr"] for group in self.param_groups]))
        if self._strategy.ending:  # loud: the parameters it pulled may not hold this gradient
            raise RuntimeError("another worker has called cleanup(): the parameter servers take no more updates "
                               "(every worker must run the same number of steps)")
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients for the next step. With set_to_none (torch's default) every p.grad is None until
        the next backward, as in torch: at ZeRO-0/1 that backward's gradients are copied into minitrain's
        flat buffer (which p.grad then views), and ZeRO-2/3 give back their gradient shard's memory until then,
        as FSDP2 frees its sharded gradients. set_to_none=False zeroes the buffers in place."""
        self._prepared.max_norm = self._prepared.pushed_norm = None
        self._strategy.zero_grad(release=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("groups are fixed by prepare(param_groups=...); prepare a new model to change them")

    def state_dict(self) -> dict:
        """The whole optimizer's state_dict in torch's format, as the user's optimizer would give it in one process
        over the whole model (its param groups, with the parameters numbered in their order). At ZeRO-0 with the
        model whole on every rank (data parallel) each rank holds all of it: local, so one rank may call it alone,
        as under DDP. Otherwise every rank's shard, slice and stage is put together on every rank: collective, and
        a rank that calls it alone is stopped, with every other, naming each rank's line (runtime/arrival.py).
        (save_checkpoint writes each rank's part instead, without gathering.)"""
        self._refuse_on_servers("state_dict")
        topo, why = self._prepared.topo, held_apart(self._prepared)
        if why is None:
            return full_optimizer_state(self._strategy, self._prepared.groups, None, topo.dp.rank, 0)
        current().arrive(topo.everyone, "optimizer.state_dict()", f"{why}, which optimizer.state_dict() puts together "
                         "from every rank: call it on every rank (and write the file on one)")
        return full_optimizer_state(self._strategy, self._prepared.groups, topo.everyone, topo.dp.rank,
                                    topo.slices.rank)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state_dict of torch's format (this optimizer's state_dict(), or a plain torch optimizer's over
        the same param groups): each rank keeps the part it holds, and every group's options (lr, betas, ...)."""
        self._refuse_on_servers("load_state_dict")
        load_optimizer_state(self._strategy, self._prepared.groups, state_dict)

    def _refuse_on_servers(self, what: str) -> None:
        if self._prepared.settings["servers"]:
            raise ValueError(f"optimizer.{what}() with prepare(servers=...): the state is on the servers, which do "
                             "not send it back through the API yet")

    def __repr__(self) -> str:
        return f"PreparedOptimizer(ZeRO-{self._strategy.stage}, {self.inner!r})"
