"""One placement rule for every tensor of a model's state_dict: how it is held under a layout, and so how
it is saved, loaded, resharded and consolidated.

Every entry of the model's own `state_dict()` is one of three kinds:
- param: a trainable parameter. It lives in the flat vectors (core/flat_parameters.py): replicated or a
  data-parallel shard by the ZeRO stage, a tensor-parallel slice where the plan splits it, on one pipeline stage.
  Saved as pieces of the logical vector, so it reshards to any layout.
- frozen: a parameter with requires_grad=False. Replicated over data-parallel ranks; a tensor-parallel
  slice where the plan splits its module (a frozen embedding at tp=2). Saved whole, once per stage: a
  slice is gathered over the tensor-parallel group first, and each rank of any layout takes its slice
  when it loads.
- buffer: a persistent buffer. Replicated; saved whole, once per stage.

Several keys may hold one tensor (a tied embedding and head): the first key is the `source` the others
point at, so a tied tensor is saved once and restored once, and stays tied. Shapes and dtypes are the
whole model's (before tensor parallelism cut anything), recorded by `whole_state` before the model is
split: what a consolidation or a load checks itself against, key by key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # core/flat_parameters.py imports this module
    from .slices import TensorSlice


@dataclass(frozen=True)
class Placement:
    key: str  # the model's own state_dict key
    kind: str  # param | frozen | buffer
    source: str  # param: its canonical name (as named_parameters gives it); else the first key holding the tensor
    shape: tuple[int, ...]  # in the whole model
    dtype: torch.dtype
    tp_slice: TensorSlice | None = None  # this rank holds the entries tp_slice.index along tp_slice.dim

    @property
    def stored(self) -> bool:
        """Saved as a tensor of its own (frozen parameters and buffers, once per tied group)."""
        return self.kind != "param" and self.source == self.key


def whole_state(model: nn.Module) -> dict[str, Placement]:
    """The placement of every state_dict entry of a whole model (before any split), in the model's order."""
    return {p.key: p for p in placements(model, {})}


def placements(model: nn.Module, slices: dict[str, TensorSlice],
               whole: dict[str, Placement] | None = None) -> list[Placement]:
    """The placement of every entry of this rank's `model` (a whole model, a pipeline stage, with tensor-parallel
    slices named in `slices`), shapes and dtypes taken from `whole` (the whole model's) where given."""
    canonical: dict[int, str] = {}
    for name, p in model.named_parameters():  # the first name of a tied parameter is its canonical one
        canonical.setdefault(id(p), name)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    first_key: dict[int, str] = {}
    out = []
    for key, value in model.state_dict(keep_vars=True).items():
        name = canonical.get(id(value))
        source = first_key.setdefault(id(value), key)
        kind = "param" if id(value) in trainable else "frozen" if name is not None else "buffer"
        known = (whole or {}).get(key)
        shape, dtype = (known.shape, known.dtype) if known is not None else (tuple(value.shape), value.dtype)
        out.append(Placement(key, kind, name if kind == "param" else source, shape, dtype,
                             slices.get(name) if name is not None else None))
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[list[int], str]], what: str,
                error=ValueError) -> None:
    """`state` has exactly the expected keys, each with the expected shape and dtype (names as dtype_name gives
    them); else `error` naming the first key that differs and how."""
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    if missing or extra:
        key = (missing or extra)[0]
        raise error(f"{what} {'lacks' if missing else 'has an unexpected'} key '{key}'"
                    + (f" (and {len(missing) + len(extra) - 1} more differences)" if len(missing) + len(extra) > 1
                       else ""))
    for key, (shape, dtype) in expected.items():
        got = state[key]
        if list(got.shape) != list(shape) or dtype_name(got.dtype) != dtype:
            raise error(f"{what}: '{key}' is {list(got.shape)} {dtype_name(got.dtype)}, the model's is "
                        f"{list(shape)} {dtype}")
