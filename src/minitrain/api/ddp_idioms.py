"""What DistributedDataParallel and FSDP2 put on a model, on the model prepare returns, so that a loop written
for them runs as it is.

prepare returns the user's model itself, not a wrapper: its parameters, names and state_dict keys are the user's.
Its class becomes a subclass of the user's class, of the same name, that adds these (FSDP2's fully_shard changes
the class the same way); cleanup() gives it its own class back.

- `model.require_backward_grad_sync = False`: DDP's switch, which nanoGPT sets before each micro-step's forward
  instead of entering no_sync(). As in DDP it is read when a forward with gradients starts, and the backward of
  that forward does not sync (minitrain.no_sync); a forward with the switch on again syncs what was accumulated.
- `model.no_sync()`: DDP's context for the micro-steps of an accumulated step (minitrain.no_sync(model)).
- `model.set_requires_gradient_sync(False)`: FSDP2's form of the same switch.
- `model.module`: refused, saying to use the model itself (DDP scripts write `raw_model = model.module`). Not the
  model itself: transformers' save_pretrained unwraps `model.module` for as long as a model has one, and a model
  that is its own `module` would never end.
- `torch.save(model)` and `copy.deepcopy(model)`: refused, saying to save its state_dict (the model holds
  minitrain's hooks; its class is not importable under its name).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .session import Prepared, state_of
from .steps import no_sync


class DataParallelIdioms:
    """The methods a prepared model gains (see the module docstring)."""

    @property
    def require_backward_grad_sync(self) -> bool:
        return state_of(self).sync_requested

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        state_of(self).sync_requested = bool(value)

    def no_sync(self):
        """DDP's: backward without the gradient sync, for all but the last micro-batch of a step."""
        return no_sync(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's: whether the backwards of the forwards that follow sync the gradients (recurse: every
        submodule's, which is all one here)."""
        state_of(self).sync_requested = bool(requires_gradient_sync)

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a prepared {type(self).__name__} is not pickled or copied whole (torch.save(model), "
                        "copy.deepcopy): minitrain's hooks and shards are in it; save model.state_dict(), or "
                        "minitrain.full_state_dict(model) (collective) at ZeRO-3")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            if name == "module":
                raise AttributeError(f"minitrain.prepare returns your {type(self).__name__} itself, not a wrapper: use "
                                     "the model where a DDP script uses model.module") from None
            raise


def adopt(model: nn.Module) -> None:
    """Give the model DataParallelIdioms: its class becomes a subclass of its own of the same name."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (DataParallelIdioms, cls),
                           {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def follow_sync_requests(model: nn.Module, state: Prepared):
    """A forward pre-hook (its handle) that enters the strategy's no_sync when a forward with gradients starts while
    the user's switch says not to sync, and leaves it when one starts with the switch on again: DDP reads
    require_backward_grad_sync at the same moment. Run eagerly under torch.compile (it keeps Python state)."""
    @torch.compiler.disable
    def follow(_module, _args) -> None:
        if not torch.is_grad_enabled():
            return
        if not state.sync_requested and state.unsynced is None:
            state.unsynced = contextlib.ExitStack()
            state.unsynced.enter_context(state.strategy.no_sync())
        elif state.sync_requested and state.unsynced is not None:
            state.unsynced.close()
            state.unsynced = None

    return model.register_forward_pre_hook(follow)
