"""Where ZeRO-3 must see a unit's parameters being used, for a model it did not write.

ZeRO-3 (zero/sharded_units.py) gathers a unit's parameters in its module's forward pre-hook and frees them after, and
gathers them again when the first gradient reaches the module's output. Two things a model may do break
that, and both would read freed memory (wrong losses, or a crash in backward):

- use a parameter outside its module's own forward: an `nn.ParameterList` indexed in the parent's forward,
  a tied weight read directly (`F.linear(x, self.embed.weight)`), a loss that calls a submodule;
- return something the output hook does not look into (a dataclass, an object of its own).

`GatherOnUse` is a TorchFunctionMode active while the model (or any unit, called on its own) runs forward:
an op that receives a parameter whose unit is not gathered has the unit gathered first, and the unit stays
gathered until its gradient is reduced (its user's backward reads it again). `tensors_in` (core/units.py) finds every
tensor in any output (containers, dataclasses, objects' attributes); sharded_units.py refuses, naming the type, an
output in which it finds none that requires grad, since the unit's backward could then not be seen.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode


class GatherOnUse(TorchFunctionMode):
    """Calls `use(unit index)` before any op that receives a parameter of `unit_of` (id -> unit index) whose unit
    `is_whole(unit index)` says is not gathered."""

    def __init__(self, unit_of: dict[int, int], is_whole: Callable[[int], bool], use: Callable[[int], None]):
        super().__init__()
        self.unit_of, self.is_whole, self.use = unit_of, is_whole, use

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg in (*args, *kwargs.values()):
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                # Parameters only: an activation's identity, which torch.compile would guard on, is never asked.
                unit = self.unit_of.get(id(t)) if isinstance(t, torch.nn.Parameter) else None
                if unit is not None and not self.is_whole(unit):
                    self.use(unit)
        return func(*args, **kwargs)
