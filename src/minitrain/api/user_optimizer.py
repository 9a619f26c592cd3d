"""An optimizer the user made before prepare, as a DDP script makes one before it wraps the model
(`optimizer = model.configure_optimizers(...)`, `optimizer.load_state_dict(checkpoint["optimizer"])`, then
`model = DDP(model)`): `prepare(model, optimizer)` takes it as it is.

- Its class is made again, with its defaults, over the tensors minitrain holds (this rank's shard), and each of
  its param groups keeps its options; a class that cannot be made again that way (a wrapper of another
  optimizer, a subclass keeping a setting of its own outside its defaults) is refused, saying to pass what makes
  it instead. Its step hooks (an EMA of the weights after each step) go with it to the prepared optimizer.
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

from ..parallel.core.shard_optimizer import OptimizerFn

NOT_OPTIONS = ("params", "param_names")  # what a param group holds besides its options


@dataclass
class TakenOptimizer:
    maker: OptimizerFn  # the user's class with its defaults: makes it again over other tensors
    groups: list[dict]  # its param groups: the user's own dicts
    state: dict | None  # its state_dict(), when it holds state to carry over
    source: torch.optim.Optimizer  # the optimizer itself, retired once prepare has carried it over

    def step_hooks(self) -> tuple[dict, dict]:
        """Its step pre- and post-hooks (handles' ids to hooks), for the prepared optimizer to call."""
        return self.source._optimizer_step_pre_hooks, self.source._optimizer_step_post_hooks


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
    if any(getattr(optimizer, hooks, None) for hooks in _STATE_HOOKS):
        raise ValueError(f"this {cls.__name__} has state_dict or load_state_dict hooks, which prepare cannot carry "
                         "over: register them on the optimizer prepare returns")
    return taken


_STATE_HOOKS = ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def _check_remade(taken: TakenOptimizer, cls: type) -> None:
    """Each param group's options, given to the class made again on a probe tensor, come back as they were, and so
    does every setting the optimizer keeps of its own (an attribute a torch optimizer does not have)."""
    instead = (f"pass what makes it instead, e.g. functools.partial({cls.__name__}, ...), with param_groups=...")
    for i, group in enumerate(taken.groups):
        options = {k: v for k, v in group.items() if k not in NOT_OPTIONS}
        try:
            probe = taken.maker([{"params": [torch.zeros(2, requires_grad=True)], **options}])
        except Exception as e:  # noqa: BLE001 - any failure: it cannot be made again from its defaults
            raise ValueError(f"prepare could not make {cls.__name__} again over its shard of the parameters from its "
                             f"defaults ({type(e).__name__}: {e}); {instead}") from e
        remade = probe.param_groups[0]
        differ = sorted(k for k in {*options, *remade} - set(NOT_OPTIONS) if not _same(options.get(k), remade.get(k)))
        if differ:
            raise ValueError(f"{cls.__name__} made again with param group {i}'s options changes {', '.join(differ)}; "
                             f"{instead}")
    # (Its public settings: a scheduler patches `step` onto it and notes `_opt_called`, which are not settings.)
    own = {k: v for k, v in vars(taken.source).items()
           if k not in _torch_attributes() and not k.startswith("_") and not callable(v)}
    differ = sorted(k for k, v in own.items() if not _same(v, vars(probe).get(k, _MISSING)))
    if differ:
        raise ValueError(f"{cls.__name__} keeps {', '.join(differ)} of its own, which made again from its defaults "
                         f"differ{'s' if len(differ) == 1 else ''} from yours; {instead}")


_MISSING = object()


def _torch_attributes() -> set[str]:
    """What every torch optimizer holds (its groups, state, defaults, hook tables, torch's own flags)."""
    return set(vars(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not known to be the same
        return False


def show(groups: list[dict], names: list[list[str]], params: dict[str, torch.nn.Parameter]) -> None:
    """Point each of the user's param groups at the prepared model's parameters of its names (the same objects but
    where the model was split; a pipeline stage shows only its own): what PreparedOptimizer.param_groups holds."""
    for group, group_names in zip(groups, names):
        if "param_names" in group:  # the user's names for them, in the same order
            group["param_names"] = [user for user, name in zip(group["param_names"], group_names) if name in params]
        group["params"] = [params[name] for name in group_names if name in params]


def stepped(taken: TakenOptimizer) -> bool:
    """Whether it holds more state than its class makes when it is made (Adagrad's sums): loaded, or stepped."""
    if taken.state is None:
        return False
    fresh = taken.maker([{**g, "params": list(g["params"])} for g in taken.groups]).state_dict()["state"]
    theirs = taken.state["state"]
    return fresh.keys() != theirs.keys() or any(
        entry.keys() != theirs[i].keys() or not all(_same(v, theirs[i][k]) for k, v in entry.items())
        for i, entry in fresh.items())


def retire(optimizer: torch.optim.Optimizer) -> None:
    """The user's own optimizer, once prepare has carried it over: its state goes (the prepared optimizer holds
    it), and stepping it is refused (it would update the parameters behind minitrain's back)."""
    optimizer.state = defaultdict(dict)
    # The prepared optimizer steps in its place: a scheduler made on this one, which notes whether it has stepped,
    # would warn at its first step that it never did.
    optimizer._opt_called = True

    def refuse(_optimizer, _args, _kwargs):
        raise RuntimeError(f"this {type(optimizer).__name__} was given to minitrain.prepare, which returned the "
                           "optimizer to train with: `model, optimizer = minitrain.prepare(model, optimizer)`, then "
                           "step that one")

    optimizer.register_step_pre_hook(refuse)
