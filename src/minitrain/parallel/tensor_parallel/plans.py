"""Tensor-parallel plans: which module of a model becomes which tensor-parallel layer, by name.

A plan maps module-name patterns to styles, the format torchtitan, PyTorch's `parallelize_module`
and Hugging Face's `base_model_tp_plan` use:

    {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
     "model.layers.*.mlp.up_proj": "colwise", ..., "lm_head": "colwise_gather_output"}

A pattern is matched against the dotted names of `model.named_modules()` segment by segment, each
segment with fnmatch (so `layers.*.mlp` matches `layers.0.mlp`, not `layers.0.attn.mlp`). The styles
(the layers are parallel/tensor_parallel/layers.py's; Megatron-LM's split):

  colwise                nn.Linear: this rank's share of the output features; the output stays split
  rowwise                nn.Linear: this rank's share of the input features; partial outputs summed
  colwise_gather_output  colwise, then the output all-gathered whole: a head whose logits the loop reads
  vocab_embedding        nn.Embedding: rows [lo, hi) of the vocabulary; the ranks' lookups summed
  vocab_head             colwise over the vocabulary, the logits left split for a vocab_loss
  vocab_loss             nn.CrossEntropyLoss: the vocabulary-parallel cross-entropy (no full logits anywhere)
  replicated             whole on every rank (what every module no pattern names is)
  Colwise(parts=k)       a fused projection (MiniGPT's qkv): each of its k equal parts split alike

Tied weights stay tied when both modules are split alike over the vocabulary (an embedding and a
head); a tie the plan splits on one side only is refused. Every refusal is one ValueError naming the
module and what to change: a pattern that matches nothing, a style on a module it cannot apply to
(GPT-2's transposed Conv1D included), a degree that does not divide the features, the vocabulary,
or the attention heads and key-value heads of a Hugging Face config.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...runtime.comm import Comm
from ..core.model_plan import matches
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    even_split,
)


@dataclass(frozen=True)
class Colwise:
    parts: int = 1  # a fused projection's equal parts (q, k, v), each split alike
    gather_output: bool = False


@dataclass(frozen=True)
class Rowwise:
    pass


@dataclass(frozen=True)
class VocabEmbedding:
    pass


@dataclass(frozen=True)
class VocabLoss:
    pass


@dataclass(frozen=True)
class Replicated:
    pass


Style = Colwise | Rowwise | VocabEmbedding | VocabLoss | Replicated
STYLES: dict[str, Style] = {
    "colwise": Colwise(), "rowwise": Rowwise(), "colwise_gather_output": Colwise(gather_output=True),
    "vocab_embedding": VocabEmbedding(), "vocab_head": Colwise(), "vocab_loss": VocabLoss(),
    "replicated": Replicated(),
    # The names Hugging Face plans use for the same layers.
    "embedding_rowwise": VocabEmbedding(), "replicate": Replicated(),
}
TpPlan = dict[str, "str | Style"]
# Styles Hugging Face plans use that minitrain does not implement (mixtures of experts, packed projections, ...).
HUGGING_FACE_ONLY = ("packed_colwise", "packed_rowwise", "moe_tp_experts", "local_colwise", "local_rowwise",
                     "local_packed_rowwise", "local", "gather", "ep_router", "grouped_gemm", "sequence_parallel",
                     "isolated", "mla_kv_a_proj")


def resolve(model: nn.Module, plan: TpPlan) -> dict[str, Style]:
    """{module name: style} for every module the plan names; ValueError for a pattern that matches nothing,
    an unknown style, or a module two patterns claim."""
    names = [name for name, _ in model.named_modules() if name]
    out: dict[str, Style] = {}
    claimed_by: dict[str, str] = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in STYLES:
                hint = (" (a Hugging Face style for packed or expert weights, which minitrain's tensor parallelism "
                        "does not split: give tp_plan without it, leaving that module replicated)"
                        if style in HUGGING_FACE_ONLY else "")
                raise ValueError(f"tp_plan['{pattern}'] = '{style}' is not a style minitrain knows{hint}; use one of "
                                 f"{', '.join(STYLES)}")
            style = STYLES[style]
        found = [name for name in names if matches(pattern, name)]
        if not found:
            examples = ", ".join(names[:4])
            raise ValueError(f"tp_plan pattern '{pattern}' matches no module of {type(model).__name__} (its module "
                             f"names look like: {examples}, ...)")
        for name in found:
            if name in claimed_by:
                raise ValueError(f"module '{name}' is matched by tp_plan patterns '{claimed_by[name]}' and "
                                 f"'{pattern}'; give it one style")
            claimed_by[name] = pattern
            out[name] = style
    return out


def check_heads(model: nn.Module, degree: int) -> None:
    """A Hugging Face config's attention heads and key-value heads must divide over the tensor-parallel
    ranks: each rank keeps whole heads (and under grouped-query attention, whole key-value heads with the
    query heads that share them), and the model's own `-1` head reshapes then see fewer of them."""
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value % degree:
            what = "key-value heads (grouped-query attention)" if attr == "num_key_value_heads" else "attention heads"
            raise ValueError(f"tp={degree} does not divide {type(model).__name__}'s {value} {what} "
                             f"(config.{attr}); each tensor-parallel rank needs whole heads: pick tp dividing it")


def check_plan(model: nn.Module, plan: TpPlan, degree: int) -> dict[str, Style]:
    """{module name: style} of a plan that applies to the model at this degree; else one ValueError naming the
    module and what to change (said before any rank splits anything)."""
    styles = resolve(model, plan)
    check_heads(model, degree)
    for name, style in styles.items():
        _check_module(name, model.get_submodule(name), style, degree)
    return styles


def apply_tensor_parallel(model: nn.Module, plan: TpPlan, comm: Comm) -> None:
    """Replace the plan's modules by their tensor-parallel slices over `comm`, in place."""
    if comm.world_size == 1:
        return
    styles = check_plan(model, plan, comm.world_size)
    ties = _ties(model)
    for name, style in styles.items():
        if isinstance(style, Replicated):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _parallel_layer(getattr(parent, child), style, comm))
    _retie(model, ties, styles)


def _check_plain_forward(name: str, module: nn.Module, base: type[nn.Module]) -> None:
    """The tensor-parallel layer replaces the module, forward included: one whose class has a forward of its own
    (an embedding that scales its output, as Gemma's does) would lose what it adds, so it is refused."""
    if type(module).forward is not base.forward:
        raise ValueError(f"'{name}' is a {type(module).__name__}, whose forward is its own, not {base.__name__}'s; "
                         f"a tensor-parallel {base.__name__} would replace it and drop what that forward does: "
                         "leave it out of tp_plan (replicated)")


def _check_module(name: str, module: nn.Module, style: Style, T: int) -> None:
    """Can `style` split this module over T ranks? ValueError naming it and what to change, if not."""
    if isinstance(style, Replicated):
        return
    if isinstance(style, (Colwise, Rowwise)):
        _require_linear(name, module, style)
        if isinstance(style, Rowwise):
            _require_divides(name, "input features", module.in_features, T)
            return
        if module.out_features % style.parts:
            raise ValueError(f"'{name}' has {module.out_features} output features, not {style.parts} equal parts")
        _require_divides(name, "output features" + (" per part" if style.parts > 1 else ""),
                         module.out_features // style.parts, T)
        return
    if isinstance(style, VocabEmbedding):
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"style vocab_embedding applies to nn.Embedding; '{name}' is a {type(module).__name__}")
        _check_plain_forward(name, module, nn.Embedding)
        _require_divides(name, "vocabulary rows", module.num_embeddings, T)
        if module.max_norm is not None:
            raise ValueError(f"'{name}' renormalises rows (max_norm), which the vocabulary-parallel embedding "
                             "does not; leave it replicated")
        return
    if not (type(module) is nn.CrossEntropyLoss and module.reduction == "mean" and module.weight is None
            and module.label_smoothing == 0):
        raise ValueError(f"style vocab_loss applies to a plain nn.CrossEntropyLoss (mean, no class weights or "
                         f"label smoothing); '{name}' is {module!r}")


def _parallel_layer(module: nn.Module, style: Style, comm: Comm) -> nn.Module:
    """The tensor-parallel layer of a module _check_module accepted."""
    if isinstance(style, Rowwise):
        return RowParallelLinear(module, torch.arange(*even_split(module.in_features, comm)), comm)
    if isinstance(style, Colwise):
        part = module.out_features // style.parts
        mine = torch.arange(*even_split(part, comm))
        rows = torch.cat([mine + k * part for k in range(style.parts)])
        return ColumnParallelLinear(module, rows, comm, gather_output=style.gather_output)
    if isinstance(style, VocabEmbedding):
        return VocabParallelEmbedding(module, *even_split(module.num_embeddings, comm), comm)
    return VocabParallelCrossEntropy(comm)


def _require_linear(name: str, module: nn.Module, style: Style) -> None:
    if isinstance(module, nn.Linear):
        _check_plain_forward(name, module, nn.Linear)
        return
    kind = "colwise" if isinstance(style, Colwise) else "rowwise"
    if type(module).__name__ == "Conv1D":
        raise ValueError(f"'{name}' is a transformers Conv1D (GPT-2's), which stores its weight transposed "
                         f"(in x out); style {kind} applies to nn.Linear, and minitrain has no Conv1D style yet: "
                         "train GPT-2 with data parallel or ZeRO")
    raise ValueError(f"style {kind} applies to nn.Linear; '{name}' is a {type(module).__name__}")


def _require_divides(name: str, what: str, n: int, degree: int) -> None:
    if n % degree:
        raise ValueError(f"tp={degree} does not divide the {n} {what} of '{name}'; tensor parallelism splits "
                         "them evenly across ranks")


def _ties(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) that hold one and the same parameter."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((mname, pname))
    return [group for group in holders.values() if len(group) > 1]


def _retie(model: nn.Module, ties: list[list[tuple[str, str]]], styles: dict[str, Style]) -> None:
    """Make tied parameters one again after their modules were replaced, if they were split alike."""
    for group in ties:
        split = [(m, p) for m, p in group if not isinstance(styles.get(m, Replicated()), Replicated)]
        if not split:
            continue
        if len(split) != len(group):
            whole = next(f"{m}.{p}" for m, p in group if (m, p) not in split)
            raise ValueError(f"'{split[0][0]}.{split[0][1]}' and '{whole}' share one tied weight, but the tp_plan "
                             f"splits only '{split[0][0]}': split both over the vocabulary (vocab_embedding and "
                             "vocab_head or colwise_gather_output) or neither")
        first_module = model.get_submodule(split[0][0])
        first, first_slice = getattr(first_module, split[0][1]), first_module.slices[split[0][1]]
        for mname, pname in split[1:]:
            module = model.get_submodule(mname)
            mine = module.slices[pname]
            if (mine.dim, mine.full_shape) != (first_slice.dim, first_slice.full_shape) or \
                    not torch.equal(mine.index, first_slice.index):
                raise ValueError(f"'{mname}.{pname}' is tied to '{split[0][0]}.{split[0][1]}' but the tp_plan splits "
                                 "them differently; give them matching vocabulary styles")
            setattr(module, pname, first)


def hugging_face_plan(model: nn.Module) -> TpPlan:
    """tp_plan="auto": the plan a Hugging Face model ships. Recent transformers keep the whole model's on the
    instance (`model._tp_plan`, names from the top); otherwise it is the config's `base_model_tp_plan`
    (names under the base model, e.g. `layers.*.self_attn.q_proj`, prefixed here with where the base model
    sits) plus the head's entry (`lm_head: colwise_gather_output`, so `model(...).logits` stays whole).
    A tied input embedding is split over the vocabulary too, so the tie holds."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        raise ValueError(f"tp_plan='auto' reads a Hugging Face model's own plan, and {type(model).__name__} ships "
                         "none (config.base_model_tp_plan is empty); give tp_plan as {module pattern: style}")
    plan: TpPlan = dict(model.__dict__.get("_tp_plan") or {})
    if not any(key not in getattr(type(model), "_tp_plan", {}) for key in plan):  # only the head's entry: build it
        prefix = getattr(model, "base_model_prefix", "")
        inner = prefix if prefix and hasattr(model, prefix) else ""
        plan = {f"{inner}.{k}" if inner else k: v for k, v in base.items()}
        plan.update(getattr(type(model), "_tp_plan", None) or {})
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and embedding is not None and head.weight is embedding.weight:
        names = {id(m): n for n, m in model.named_modules()}
        plan.setdefault(names[id(embedding)], "vocab_embedding")
    return plan
