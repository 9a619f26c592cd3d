"""A Hugging Face model under context parallelism (cp_plan="auto"), found by what it is:
- its attention modules look their attention function up by the name in `config._attn_implementation` (models
  that do say so: `_supports_attention_backend`), so a function doing causal attention over the group (ring or
  Ulysses, on q, k and v after the rotary embedding) is registered under a name of this model's own, and the
  config names it until the strategy closes;
- its rotary embedding module (`...RotaryEmbedding`, called with the hidden states and `position_ids`) is given
  the positions of this rank's tokens in the whole sequence, so every token is rotated by its absolute offset.
Causal masks only: a padding mask, a sliding window, attention dropout or a scale other than 1/sqrt(head_dim) is
refused with the reason, since the group's attention could not honour it.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ...runtime.comm import Comm
from .apply import attention_over, whole_sequence_positions
from .layout import ContextLayout


def check_context_parallel(model: nn.Module, cp: int = 2, style: str = "ring") -> None:
    """ValueError unless `model` is a Hugging Face model cp_plan='auto' knows how to change at this cp and style."""
    config = getattr(model, "config", None)
    if config is None or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"cp_plan='auto' changes a Hugging Face model whose attention goes through its attention "
                         f"interface, and {type(model).__name__} is not one; give the model a plan with its "
                         "attention cores (plan=ModelPlan(attention=..., positions=...))")
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if windowed or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError(f"{type(model).__name__} attends within a sliding window, and context parallelism computes "
                         "causal attention over the whole sequence only")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"attention dropout {config.attention_dropout} under context parallelism is not supported; "
                         "set the config's attention_dropout to 0")
    heads = getattr(config, "num_attention_heads", None)
    if style == "ulysses" and heads and heads % cp:
        raise ValueError(f"Ulysses attention splits the {heads} heads over cp = {cp} ranks, which does not divide "
                         "them; use a cp that divides the heads, or the ring style")
    if not rotary_modules(model):
        raise ValueError(f"cp_plan='auto' gives rotary position embeddings their absolute offsets, and "
                         f"{type(model).__name__} has none; give a plan naming its position modules")


def rotary_modules(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """The rotary embedding modules, with the index of their position_ids argument (hidden states first)."""
    return [(m, 1) for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


class RegisteredAttention:
    """The model's attention function, registered under a name of its own and named by its config; remove()
    names the previous one again and forgets it."""

    def __init__(self, model: nn.Module, attend):
        from transformers import AttentionInterface

        self.name, self.config = f"minitrain_context_{id(self)}", model.config
        self.previous = model.config._attn_implementation
        AttentionInterface.register(self.name, functools.partial(causal_attention, attend))
        self.config._attn_implementation = self.name

    def remove(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.config._attn_implementation = self.previous
        ALL_ATTENTION_FUNCTIONS._global_mapping.pop(self.name, None)


def causal_attention(attend, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function signature: (B, heads, T, d) queries and (B, kv heads, T, d) keys and
    values of this rank's tokens in; (B, T, heads, d) out, over the whole sequence."""
    if attention_mask is not None:  # a mask of any kind the model built (refuse_padding names the usual cause)
        raise ValueError("context parallelism computes causal attention over whole sequences, and this model "
                         "passed its attention a mask; pack sequences without padding")
    if dropout:
        raise ValueError(f"attention dropout {dropout} under context parallelism is not supported; set the "
                         "config's attention_dropout to 0")
    if scaling is not None and not math.isclose(scaling, query.size(-1) ** -0.5, rel_tol=1e-12):
        raise ValueError(f"this attention scales scores by {scaling}, and context parallelism by 1/sqrt(head_dim)")
    groups = query.size(1) // key.size(1)  # grouped-query attention: each key/value head serves `groups` heads
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return attend(query, key, value).transpose(1, 2).contiguous(), None


def refuse_padding(_model: nn.Module, _args: tuple, kwargs: dict) -> None:
    """The model's own forward: an attention_mask that masks any token is refused (the mask Hugging Face would
    build from it is for this rank's tokens alone, and the group's attention has none)."""
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("context parallelism computes causal attention over whole sequences: a padding mask "
                         "(attention_mask with zeros) is refused; pack sequences without padding")


def apply_to_hugging_face(model: nn.Module, comm: Comm, style: str) -> list:
    """Context parallelism over `comm` for a Hugging Face model (checked first); the handles to remove."""
    check_context_parallel(model)
    layout = ContextLayout(comm.rank, comm.world_size)
    attention = RegisteredAttention(model, attention_over(comm, style, layout))
    padding = model.register_forward_pre_hook(refuse_padding, with_kwargs=True)
    return [attention, padding, *whole_sequence_positions(rotary_modules(model), layout)]
