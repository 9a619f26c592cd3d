"""What a strategy switches on in a user's own loop (ParallelConfig.user_loop), handed to it by make_strategy.

The strategies call these and never import this folder, which sits above them: a reader of one strategy's lesson
meets a user's loop only where the strategy asks for it (`self.loop`), and the CLI's trainer, which reads no
p.grad and uses parameters only through the model's forward, is given none.
"""
from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from .freed_params import guard_freed
from .param_use import GatherOnUse
from .visible_grads import ShardedGradient, VisibleGradients


class UserLoopSupport:
    """The user-loop mechanisms, one method each, for the strategy that holds this object."""

    @staticmethod
    def visible_gradients(flat) -> VisibleGradients:
        """ZeRO-0/1: p.grad as views of the flat gradient, averaged when backward ends (visible_grads.py)."""
        return VisibleGradients(flat)

    @staticmethod
    def sharded_gradients(flat, stage: int) -> dict[str, ShardedGradient]:
        """ZeRO-2/3: what each p.grad holds once its gradient is on its way to the shard, by name."""
        return {seg.name: ShardedGradient(flat.param(seg), seg.name, stage) for seg in flat.segments}

    @staticmethod
    def guard_freed(params: list[nn.Parameter]) -> None:
        """ZeRO-3: a freed parameter read between steps is refused, not read (freed_params.py)."""
        guard_freed(params)

    @staticmethod
    def watch_uses(model: nn.Module, unit_of: dict[int, int], is_whole: Callable[[int], bool],
                   use: Callable[[int], None]) -> list:
        """ZeRO-3: GatherOnUse (param_use.py) active from the first forward pre-hook of any of the model's modules to
        its matching post-hook (a submodule a loss calls, outside the model's forward, is watched too); returns the
        hooks' handles."""
        watch = GatherOnUse(unit_of, is_whole, use)
        depth = [0]

        def enter(_module, _args):
            depth[0] += 1
            if depth[0] == 1:
                watch.__enter__()

        def leave(_module, _args, _output):
            depth[0] -= 1
            if depth[0] == 0:
                watch.__exit__(None, None, None)

        handles = []
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(enter, prepend=True))
            handles.append(module.register_forward_hook(leave, always_call=True))
        return handles
