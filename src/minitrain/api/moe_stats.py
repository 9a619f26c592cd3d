"""A mixture of experts' figures in a user's loop: `minitrain.moe_stats(model)` gives what `minitrain train` logs
each step (docs/moe.md): each expert's load over every rank, the slots dropped over capacity, and the router's
auxiliary loss, counted over the training forwards since the last call.

Where the counts come from:
- MiniGPT's layers count themselves (models/minigpt/moe.py: `take_load`), their auxiliary losses included;
- a Hugging Face MoE's experts modules (Mixtral's, Qwen2-MoE's, OLMoE's: found by `ep_plan`, or by the model's own
  `base_model_ep_plan`) are counted from the routing they are called with, and its router loss is the model
  output's `aux_loss` (there when the model runs with `output_router_logits`) times `config.router_aux_loss_coef`,
  the share of it the model's own loss carries.
A training forward counts once: not an evaluation's (model.eval(), or under no_grad for the loss), not the replay
of activation checkpointing inside backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.expert_parallel.load import ExpertLoad, dropped_share, imbalance
from ..parallel.expert_parallel.experts import HuggingFaceExperts, hugging_face_experts, routes_its_own_tokens
from ..parallel.recompute import in_backward


@dataclass
class MoEStats:
    """A mixture of experts' figures since the last moe_stats call, over every rank that reads its own data."""

    load: list[list[float]]  # per MoE layer, the slots (token x choice) each expert received
    dropped: list[float]  # per MoE layer, the slots dropped over capacity (0 when dropless)
    # The router's auxiliary losses as the gradient carries them (coefficients applied), summed over the layers,
    # the mean over the training forwards and the ranks; None when the model computed none.
    router_loss: float | None

    @property
    def imbalance(self) -> float:
        """The busiest expert's slots over the mean, at the worst layer: 1.0 is perfectly balanced."""
        return imbalance(self.load)

    @property
    def dropped_share(self) -> float:
        """The share of all slots dropped over capacity."""
        return dropped_share(self.load, self.dropped)


def training_forward(module: nn.Module) -> bool:
    """A forward whose routing is the step's: in training mode, and not activation checkpointing's replay."""
    return module.training and not in_backward()


class HuggingFaceExpertLoad:
    """Counts the routing a Hugging Face experts module is called with, forward(hidden, top_k_index, weights): the
    slots each expert receives (dropless: none dropped). The counts stay on the device until taken."""

    def __init__(self, module: nn.Module, experts: int):
        self.experts, self.counts = experts, None
        self.handle = module.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if training_forward(module):
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            counts = torch.bincount(index.reshape(-1), minlength=self.experts).to(torch.float64)
            self.counts = counts if self.counts is None else self.counts + counts

    def take_load(self) -> ExpertLoad:
        counts, self.counts = self.counts, None
        return ExpertLoad([0.0] * self.experts if counts is None else counts.tolist())


class RouterLossOfTheOutput:
    """A Hugging Face MoE's router loss, read from its output's `aux_loss` after each training forward that has one,
    weighted by `config.router_aux_loss_coef` as its own loss weighs it."""

    def __init__(self, model: nn.Module):
        self.coef = float(getattr(getattr(model, "config", None), "router_aux_loss_coef", 1.0))
        self.counted = ExpertLoad([])
        self.handle = model.register_forward_hook(self._read)

    def _read(self, module: nn.Module, _args, output) -> None:
        aux = getattr(output, "aux_loss", None)
        if isinstance(aux, torch.Tensor) and training_forward(module) and torch.is_grad_enabled():
            self.counted.router_loss = self.counted.router_loss + self.coef * aux.detach().double()
            self.counted.forwards += 1

    def take_load(self) -> ExpertLoad:
        counted, self.counted = self.counted, ExpertLoad([])
        return counted


@dataclass
class MoECounters:
    """What prepare found to count in a mixture of experts: its layers, and where its router loss is read."""

    layers: list  # each has take_load() -> ExpertLoad (models/spec.py: CountsExpertLoad)
    router: RouterLossOfTheOutput | None = None

    @property
    def handles(self) -> list:
        """The hooks put on the model, for close() to remove."""
        return [c.handle for c in (*self.layers, self.router) if hasattr(c, "handle")]

    def take(self) -> tuple[list[ExpertLoad], float, bool]:
        """This rank's counts since the last call (the counters start over): per layer, then its router loss per
        forward and whether any forward carried one."""
        counted = [layer.take_load() for layer in self.layers]
        sources = counted + ([self.router.take_load()] if self.router is not None else [])
        has_loss = any(c.forwards for c in sources)
        return counted, float(sum((c.mean_router_loss() for c in sources), 0.0)), has_loss


def moe_counters(model: nn.Module, ep_plan) -> MoECounters | None:
    """The counters of `model`'s mixture-of-experts layers (None for a dense model), found before any rank splits
    the experts: MiniGPT's by what they are, a Hugging Face model's by ep_plan (default: its own plan)."""
    own = [m for m in model.modules() if routes_its_own_tokens(m) and hasattr(m, "take_load")]
    if own:
        return MoECounters(own)
    try:
        modules = hugging_face_experts(model, "auto" if ep_plan is None else ep_plan)
        sizes = [HuggingFaceExperts(m).experts for m in modules]
    except ValueError:  # no plan of its own, or modules of another layout: nothing minitrain knows to count
        if ep_plan is not None:
            raise
        return None
    return MoECounters([HuggingFaceExpertLoad(m, e) for m, e in zip(modules, sizes)], RouterLossOfTheOutput(model))


def gather_stats(counters: MoECounters, data) -> MoEStats:
    """Every rank's counts summed over `data` (the ranks that each read their own share: one all-reduce)."""
    counted, router_loss, has_loss = counters.take()
    row = [v for c in counted for v in c.load] + [c.dropped for c in counted] + [router_loss, float(has_loss)]
    total = torch.tensor(row, dtype=torch.float64, device=data.device)
    data.all_reduce_sum(total)
    values = total.tolist()
    load, at = [], 0
    for c in counted:
        load.append(values[at:at + len(c.load)])
        at += len(c.load)
    dropped = values[at:at + len(counted)]
    ranks = data.world_size
    return MoEStats(load, dropped, values[-2] / ranks if values[-1] else None)


def moe_stats(model: nn.Module) -> MoEStats | None:
    """The mixture of experts' figures over every rank since the last call (the counts start over): each layer's
    expert load, the slots dropped and the router loss (see MoEStats); None for a model with no MoE layer
    minitrain knows. Collective: call it on every rank, e.g. where the loop logs."""
    from .session import current, state_of

    state = state_of(model)
    if state.moe is None:
        return None
    current().arrive(state.topo.data, "minitrain.moe_stats()", "it sums every rank's counts: call it on every rank")
    return gather_stats(state.moe, state.topo.data)
