"""An optimizer the user made before prepare, as a DDP script makes one before it wraps the model
(`optimizer = model.configure_optimizers(...)`, `optimizer.load_state_dict(checkpoint["optimizer"])`, then
`model = DDP(model)`): `prepare(model, optimizer)` takes it as it is.

- Its class is made again, with its defaults, over the tensors minitrain holds (this rank's shard), and each of
  its param groups keeps its options; a class that cannot be made again that way (a wrapper of another
  optimizer) is refused, saying to pass what makes it instead.
- Its param groups are the ones the prepared optimizer shows (PreparedOptimizer.param_groups): the same dicts,
  so a learning-rate scheduler made before prepare still drives the training, and their parameters are the
  model's own (mapped by identity; a tensor-parallel slice or a pipeline stage's share once the model is split).
- Whatever state it holds (loaded from a checkpoint, or from steps it took) is carried into minitrain's shards
  exactly, as optimizer.load_state_dict would put it there; then it lets go of that state (its memory is the
  prepared optimizer's to hold), and a step on it is refused: the prepared optimizer is the one that trains.
"""
from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..parallel.shard_optimizer import OptimizerFn

NOT_OPTIONS = ("params", "param_names")  # what a param group holds besides its options


@dataclass
class TakenOptimizer:
    maker: OptimizerFn  # the user's class with its defaults: makes it again over other tensors
    groups: list[dict]  # its param groups: the user's own dicts
    state: dict | None  # its state_dict(), when it holds state to carry over
    source: torch.optim.Optimizer  # the optimizer itself, retired once prepare has carried it over


def take(optimizer: torch.optim.Optimizer, param_groups) -> TakenOptimizer:
    """What prepare needs of an optimizer already made; ValueError for one it cannot make again."""
    if param_groups is not None:
        raise ValueError("param_groups goes with an optimizer's maker; the optimizer you made has its param groups "
                         "already (pass it alone, or pass its maker with param_groups)")
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if any_keyword or k in accepted}
    taken = TakenOptimizer(functools.partial(cls, **defaults), optimizer.param_groups,
                           optimizer.state_dict() if optimizer.state else None, optimizer)
    _check_remade(taken, cls)
    return taken


def _check_remade(taken: TakenOptimizer, cls: type) -> None:
    """Each param group's options, given to the class made again on a probe tensor, come back as they were."""
    for i, group in enumerate(taken.groups):
        options = {k: v for k, v in group.items() if k not in NOT_OPTIONS}
        try:
            remade = taken.maker([{"params": [torch.zeros(2, requires_grad=True)], **options}]).param_groups[0]
        except Exception as e:  # noqa: BLE001 - any failure: it cannot be made again from its defaults
            raise ValueError(f"prepare could not make {cls.__name__} again over its shard of the parameters from its "
                             f"defaults ({type(e).__name__}: {e}); pass what makes it instead, e.g. "
                             f"functools.partial({cls.__name__}, ...), with param_groups=...") from e
        differ = sorted(k for k in {*options, *remade} - set(NOT_OPTIONS) if not _same(options.get(k), remade.get(k)))
        if differ:
            raise ValueError(f"{cls.__name__} made again with param group {i}'s options changes {', '.join(differ)}; "
                             f"pass what makes it instead, e.g. functools.partial({cls.__name__}, ...), with "
                             "param_groups=...")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def show(groups: list[dict], names: list[list[str]], params: dict[str, torch.nn.Parameter]) -> None:
    """Point each of the user's param groups at the prepared model's parameters of its names (the same objects but
    where the model was split; a pipeline stage shows only its own): what PreparedOptimizer.param_groups holds."""
    for group, group_names in zip(groups, names):
        if "param_names" in group:  # the user's names for them, in the same order
            group["param_names"] = [user for user, name in zip(group["param_names"], group_names) if name in params]
        group["params"] = [params[name] for name in group_names if name in params]


def retire(optimizer: torch.optim.Optimizer) -> None:
    """The user's own optimizer, once prepare has carried it over: its state goes (the prepared optimizer holds
    it), and stepping it is refused (it would update the parameters behind minitrain's back)."""
    optimizer.state = defaultdict(dict)

    def refuse(_optimizer, _args, _kwargs):
        raise RuntimeError(f"this {type(optimizer).__name__} was given to minitrain.prepare, which returned the "
                           "optimizer to train with: `model, optimizer = minitrain.prepare(model, optimizer)`, then "
                           "step that one")

    optimizer.register_step_pre_hook(refuse)
