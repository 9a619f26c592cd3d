"""ZeRO-3's parameters between steps, in a user's own loop: freed, and refused by name instead of read.

ZeRO-3 (zero3.py) keeps each parameter's shape but gives its storage back between uses: a rank holds only its
shard, and the whole parameter exists while its module's forward and backward need it. Code of the user's that
reads a parameter then (an EMA of the weights, a logged norm, `print(p)`, `p.detach().clone()`) used to read
freed memory: garbage, or the process killed by SIGSEGV with no word of why.

`Zero3Parameter` is the class such a parameter takes in a user's loop (prepare(zero=3)): an op given one whose
storage is freed raises, saying what to do instead; on a gathered one every op runs as on any parameter (inside
the model's forward, GatherOnUse gathers a parameter before the op reaches here). Reading what it is (shape,
dtype, device, numel, its `.grad`, hooks) never touches its values and is always allowed. The check is Python
work per op that receives a parameter: in the forward, beside GatherOnUse's, a few microseconds per such op.
"""
from __future__ import annotations

import torch
import torch.nn as nn

# What reads only a tensor's description, not its values: allowed on a freed parameter.
DESCRIPTION = frozenset({
    "numel", "size", "dim", "nelement", "ndimension", "element_size", "is_floating_point", "is_complex", "stride",
    "storage_offset", "is_contiguous", "data_ptr", "untyped_storage", "requires_grad_", "get_device", "is_pinned",
    "is_shared", "__len__", "register_hook", "register_post_accumulate_grad_hook", "_is_view"})


def freed(t: torch.Tensor) -> bool:
    """Whether t's storage no longer holds its elements (ZeRO-3 resized it to nothing). Call with subclass
    torch functions disabled."""
    return t.numel() > 0 and t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()


def _reads_values(func) -> bool:
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__"):  # an attribute: its description, .grad, ...; but .data is its values
        return name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", None) == "data"
    return name not in DESCRIPTION


def _what(func) -> str:
    """How the refusal names the op: `norm`, `.data`."""
    name = getattr(func, "__name__", str(func))
    return f".{func.__self__.__name__}" if name == "__get__" else name


class Zero3Parameter(nn.Parameter):
    """A parameter ZeRO-3 frees between uses (see the module's text). Ops return plain tensors, as on any
    nn.Parameter."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if _reads_values(func):
                for arg in (*args, *kwargs.values()):
                    for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                        if isinstance(t, cls) and freed(t):
                            raise RuntimeError(
                                f"{_what(func)} of a parameter of shape {tuple(t.shape)} that "
                                "ZeRO-3 has freed: between steps each rank holds only a shard of it (the whole "
                                "exists while the model's forward and backward use it). Read the whole model with "
                                "minitrain.full_state_dict(model) on every rank, or use the parameter inside the "
                                "model's forward")
            return func(*args, **kwargs)


def guard_freed(params: list[nn.Parameter]) -> None:
    """Make each plain nn.Parameter of `params` a Zero3Parameter (the same object: the user's references, the
    optimizer's and autograd's stay valid). A parameter of another class (a quantized one's) keeps its own."""
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = Zero3Parameter
