"""ZeRO-3's parameters between steps, in a user's own loop: freed, and refused by name instead of read.

ZeRO-3 (parallel/zero/sharded_units.py) keeps each parameter's shape but gives its storage back between uses: a
rank holds only its shard, and the whole parameter exists while its module's forward and backward need it. Code of
the user's that reads a parameter then (an EMA of the weights, a logged norm, `print(p)`, `p.detach().clone()`)
would read freed memory: garbage, or the process killed by SIGSEGV with no word of why.

`Zero3Parameter` is the class such a parameter takes in a user's loop (prepare(zero=3)): an op given one whose
storage is freed raises, saying what to do instead; on a gathered one every op runs as on any parameter (inside
the model's forward, GatherOnUse gathers a parameter before the op reaches here). Reading what it is (shape,
dtype, device, numel, its `.grad`, hooks, a conversion to the dtype and device it has) never touches its values
and is allowed. The check is Python work per op that receives a parameter, a few microseconds each.

Not covered (they still read freed memory): a view taken while the parameter was gathered (a hook
that keeps `m.weight[0]`) read after the step; torch.tensor(p), as_subclass and DLPack, which bypass
__torch_function__; code compiled by torch.compile, which is not checked so that a compiled forward keeps its
graph whole.
"""
from __future__ import annotations

import torch
import torch.nn as nn

# What reads only a tensor's description, not its values: allowed on a freed parameter. (torch.autograd.grad and
# backward(inputs=...) name parameters without reading them; the *_like and new_* ops take their dtype and device.)
DESCRIPTION = frozenset({
    "numel", "size", "dim", "nelement", "ndimension", "element_size", "is_floating_point", "is_complex", "stride",
    "storage_offset", "is_contiguous", "data_ptr", "untyped_storage", "requires_grad_", "get_device", "is_pinned",
    "is_shared", "__len__", "register_hook", "register_post_accumulate_grad_hook", "_is_view", "is_conj", "is_neg",
    "is_inference", "_has_compatible_shallow_copy_type", "grad", "backward", "zeros_like", "ones_like", "empty_like",
    "new_zeros", "new_ones", "new_empty"})
# Conversions that give the parameter itself when it already has that dtype (model.float()).
CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


def freed(t: torch.Tensor) -> bool:
    """Whether t's storage no longer holds its elements (ZeRO-3 resized it to nothing). Call with subclass
    torch functions disabled."""
    return t.numel() > 0 and t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()


def _reads_values(func) -> bool:
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__"):  # an attribute: its description, .grad, ...; but .data is its values, and
        # `p.data = x` would unbind it from ZeRO-3's buffer (the forward would compute with x from then on)
        return getattr(getattr(func, "__self__", None), "__name__", None) == "data"
    return name not in DESCRIPTION


def _gives_itself(func, args, kwargs) -> bool:
    """Whether `func` would give the parameter args[0] itself, reading nothing: a conversion to the device and dtype
    it has (`model.to(device)`, `model.float()`, `p.cpu()`), or Module._apply's `p.data = p` after one."""
    name, t = getattr(func, "__name__", None), args[0] if args else None
    if not isinstance(t, torch.Tensor):
        return False
    if name == "__set__":
        return len(args) == 2 and args[1] is t
    if name in CASTS or name == "cpu":
        wanted = t.device.type == "cpu" if name == "cpu" else t.dtype == CASTS[name]
        return wanted and len(args) == 1 and not kwargs
    if name == "to" and not kwargs.get("copy"):
        try:
            device, dtype, _, layout = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                            if k != "copy"})
        except (TypeError, RuntimeError):
            return False
        same_device = device is None or (device.type == t.device.type and device.index in (None, t.device.index))
        return same_device and dtype in (None, t.dtype) and layout in (None, torch.preserve_format)
    return False


def _what(func) -> str:
    """How the refusal names the op: `norm`, `.data`."""
    name = getattr(func, "__name__", str(func))
    return f".{func.__self__.__name__}" if name in ("__get__", "__set__") else name


class Zero3Parameter(nn.Parameter):
    """A parameter ZeRO-3 frees between uses (see the module's text). Ops return plain tensors, as on any
    nn.Parameter."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            # Traced by torch.compile (a compiled block's forward): a check there would break the graph at every
            # op, so compiled code goes unchecked, as a plain parameter is.
            if _reads_values(func) and not torch.compiler.is_compiling():
                for arg in (*args, *kwargs.values()):
                    for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                        if isinstance(t, cls) and freed(t) and not _gives_itself(func, args, kwargs):
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
