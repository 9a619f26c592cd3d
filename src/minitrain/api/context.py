"""Context parallelism in a user's loop: prepare's checks of cp (context_plan), what the loop calls to give the
model this rank's tokens (context_shard), and the check before each forward that it did (check_context_inputs)."""
from __future__ import annotations

import torch
from torch import nn

from ..parallel.context_parallel.hugging_face import check_context_parallel
from ..parallel.core.model_plan import ModelPlan
from ..parallel.expert_parallel.experts import routes_its_own_tokens
from .session import Prepared, state_of
from .steps import note_feed


def context_plan(model: nn.Module, plan: ModelPlan | None, cp: int, style: str, cp_plan, others: dict,
                  world: int) -> str | None:
    """How context parallelism finds the model's attention ("auto": a Hugging Face model's own; None: the plan's),
    checked before anything changes; ValueError saying why not otherwise."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp must be an integer >= 1, got {cp!r}")
    if cp == 1:
        return None
    if world % cp:
        raise ValueError(f"cp={cp} does not divide the world size {world}: launch a multiple of cp processes "
                         "(torchrun --nproc-per-node)")
    clashes = [f"{k}={v}" for k, v in others.items() if v not in (0, 1)]
    if clashes or any(routes_its_own_tokens(m) for m in model.modules()):
        raise ValueError(f"cp={cp} with {', '.join(clashes) or 'a mixture of experts'}: context parallelism "
                         "composes with data parallelism and ZeRO only for now")
    if style not in ("ring", "ulysses"):
        raise ValueError(f"cp_style must be ring or ulysses, got {style!r}")
    if cp_plan not in (None, "auto"):
        raise ValueError(f"cp_plan is 'auto' (a Hugging Face model's attention) or None (the plan's), got {cp_plan!r}")
    if cp_plan is None and plan is not None and plan.attention is not None:
        return None
    check_context_parallel(model, cp, style)
    return "auto"


def context_shard(model: nn.Module, *tensors: torch.Tensor):
    """This rank's tokens of each whole-sequence tensor (B, T, ...) of a model prepared with cp > 1: its two chunks
    of 2 x cp along dim 1, side by side (as the model's attention expects them). Targets must be shifted before
    (inputs x[:, :-1], targets x[:, 1:]): the chunks are not contiguous. One tensor in, one out; several, a tuple.
    Without context parallelism each is returned as it is."""
    state = state_of(model)
    context = state.context
    if context is not None:  # every rank of the group must cut the same sequences (checked at the step)
        note_feed(state, tensors)
    shards = tuple(t if context is None else context.local(t) for t in tensors)
    if context is not None and shards:
        state.context_tokens = shards[0].size(1)
    return shards[0] if len(shards) == 1 else shards


def check_context_inputs(state: Prepared, _model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Under context parallelism, before the model's forward: its tokens are this rank's (context_shard's), and
    nothing is passed that the split would make wrong; ValueError saying what to do otherwise."""
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError("labels= makes a Hugging Face model shift the labels inside this rank's tokens, whose two "
                         "chunks are not adjacent: compute the loss from the logits and the targets context_shard "
                         "gives (shifted before the cut), or pass shift_labels=targets")
    if kwargs.get("position_ids") is not None:
        raise ValueError("under context parallelism the rotary positions are given their offsets in the whole "
                         "sequence by minitrain: do not pass position_ids")
    tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return
    if state.context_tokens is None or tokens.size(1) != state.context_tokens:
        whole = f"{tokens.size(1)} tokens" + ("" if state.context_tokens is None else
                                              f", where context_shard gave {state.context_tokens}")
        raise ValueError(f"the model was given {whole}: under cp each rank gives it its own tokens of the sequences, "
                         "inputs, targets = minitrain.context_shard(model, inputs, targets)")
