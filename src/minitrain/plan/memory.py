"""Memory per rank, by kind.

- parameters, gradients, optimizer state: the ZeRO memory math (`parallel.core.memory_math.memory_terms`,
  the same rule the strategies' memory profile checks). In fp32 the optimizer holds master, m
  and v (3 x 4 bytes/param; at ZeRO-3 the parameter shard is the master, so 2 x 4). In bf16/fp16
  (train/precision.py) parameters take 2 bytes, the optimizer K = 12 bytes/param (fp32 master, m, v),
  and gradients 2 bytes, except ZeRO-2/3's gradient shard, which is in the reduce dtype (4 bytes
  with the default --reduce-dtype fp32; --reduce-dtype compute gives the ZeRO paper's 2+2+K).
  P is the padded flat size the strategy lays out (each unit padded to a multiple of the
  data-parallel degree), so at-rest figures equal the measured ones exactly.
- activations: what autograd keeps for backward, per micro-batch and layer, counted from
  MiniGPT's operations (b micro-batch, s sequence, h width, a heads, f MLP width, E bytes):
  E(8bsh + 2bsf + 4bs) + 4abs with the fused attention kernel (flash attention keeps a float32
  log-sum-exp per query row, never the scores), or E(8bsh + 2bsf + a b s^2 + 4bs) + s^2 (the
  softmax of the scores and the causal mask) with --model.attention explicit; plus, outside the blocks,
  E(2bsh + 2bs) + E'bsV (E' = 4 in mixed precision on the CPU, whose autocast computes the loss's
  log-probabilities in float32; E + 4 on CUDA, whose autocast keeps them in the compute dtype and the NLL loss a
  float32 copy) and the token ids. Selective recomputation drops the attention core's term; block recomputation
  keeps one bsh input per layer plus one layer's full set (replayed in backward). A pipeline stage keeps its
  layers' activations for every micro-batch in flight: min(pp, micro-batches) under 1F1B, all of them under GPipe.
  Under context parallelism every term is at s / cp, the rank's tokens, plus what the group's attention keeps
  (context_activation_bytes).
- transients: ZeRO-3's gathered units, the gradient sync's float32 copy, the loss's backward, the update's
  upcast chunk (the optimizer's, train/optim.py), each at the moment it is held.

Tensor and pipeline parallel degrees divide the parameters evenly (P / (tp pp), an approximation:
LayerNorms are replicated under TP, and the first and last stages also hold the embedding and
head; those figures are not checked against measurement as the data-parallel ones are).
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..config import ModelConfig
from ..parallel.pipeline_parallel.schedules import interleaved, peak_in_flight
from ..models.size import model_units
from ..parallel.core.memory_math import memory_terms, term_bytes
from ..train.optim import FlatAdamW
from .inputs import PlanInput, element_bytes, layout_params, local_seq, reduce_bytes, shard_ranks


def state_element_bytes(inp: PlanInput) -> dict[str, int]:
    """Bytes per element of each kind, as the strategies hold them (FlatStrategy.element_sizes)."""
    elem = element_bytes(inp.precision)
    return {"params": elem, "grads": reduce_bytes(inp) if inp.zero >= 2 else elem, "optimizer": 4}


def units_freed(inp: PlanInput) -> bool:
    """ZeRO-2 frees each unit's full parameters after backward, gathering them from the master: in full precision,
    not offloaded (ShardedUnits.frees_after_backward)."""
    return inp.zero == 2 and inp.precision == "fp32" and inp.offload == "none"


def model_state_bytes(inp: PlanInput) -> dict[str, int]:
    mixed, P, elem = inp.precision != "fp32", layout_params(inp), state_element_bytes(inp)
    out = {}
    # fp32 keeps a separate master except at ZeRO-2/3 (the parameter shard is the master, and ZeRO-2 frees its full
    # parameters after backward: parallel/zero/sharded_units.py); mixed precision always does, and so does offload
    # (the master goes with the state, the shard stays with the model).
    shard_is_master = units_freed(inp) or (inp.zero == 3 and not mixed and inp.offload == "none")
    for kind, terms in memory_terms(inp.zero, master_is_params=shard_is_master).items():
        out[kind] = round(term_bytes(terms, elem[kind], P, P / shard_ranks(inp)))
    if inp.servers:  # a parameter-server worker: the servers hold the optimizer
        out["optimizer"] = 0
    return out


def gathered_bytes(inp: PlanInput) -> int:
    """ZeRO-3's transient: full parameters of the units gathered at once. The shared unit (tied
    weights) stays gathered through forward and backward; of the others, at the start of backward
    (the activations all still alive), the one computing, the one prefetched, and the one before
    them whose gradient is still being reduced when its reduce-scatter has not completed yet (its
    parameters are freed when it has): the largest, three times. Other stages hold no full-size
    transient then. Without a model, no unit sizes are known: 0."""
    if inp.zero < 3 or inp.model is None:
        return 0
    units = model_units(inp.model, inp.ep)
    shared = units.pop("shared", 0)
    in_flight = 3 if shard_ranks(inp) > 1 else 2  # one rank: the reduction is done when it returns
    return round(element_bytes(inp.precision) * (shared + in_flight * max(units.values())) / inp.tp)


def update_transients(inp: PlanInput) -> tuple[int, int]:
    """(bytes held beside the activations in backward, bytes held beside the state during the update).
    Backward: ZeRO-0/1 in mixed precision reducing in fp32 sum a float32 copy of the whole gradient
    (started by the first bucket, held through the update); offloaded at ZeRO-2/3, the device chunk a unit's
    reduce-scatter lands in. Update: that copy, and in mixed precision
    the optimizer's upcast gradient chunk (its fused kernel needs no other temporary)."""
    mixed, P = inp.precision != "fp32", layout_params(inp)
    # (one data-parallel rank sums nothing: no copy; parallel/core/strategy.py's sum_dtype)
    wide = 4 * P if inp.zero <= 1 and mixed and reduce_bytes(inp) == 4 and inp.dp > 1 else 0
    landing = 0
    if inp.offload != "none" and inp.zero >= 2 and inp.model is not None:
        # The gradient shard is on the host: each unit's reduce-scatter lands in a device chunk first.
        landing = round(reduce_bytes(inp) * max(model_units(inp.model, inp.ep).values()) /
                        (shard_ranks(inp) * inp.tp))
    shard = P if inp.zero == 0 else P / shard_ranks(inp)
    update = wide + (4 * min(shard, FlatAdamW.chunk_for(inp.hardware.device)) if mixed else 0)
    return wide + landing, round(update)


def layer_activation_bytes(cfg: ModelConfig, b: int, elem: int, mode: str, cp: int = 1, style: str = "ring") -> int:
    """What one block keeps for backward (see the module docstring), holding 1/cp of each sequence."""
    s, h, a, f = cfg.seq_len // cp, cfg.d_model, cfg.n_head, cfg.ffn_dim
    if cp > 1 and mode != "block":  # every token-wise term at s / cp; the attention is the group's, whose own
        # tensors selective recomputation replays rather than keeps
        kept = layer_activation_bytes(replace(cfg, seq_len=s, attention="sdpa"), b, elem, mode)
        return kept + (context_activation_bytes(b, s, h, elem, style, cfg.seq_len) if mode == "none" else 0)
    if cfg.attention == "explicit":
        core = elem * a * b * s * s + s * s  # the scores' softmax and the causal mask
    else:
        core = 4 * a * b * s  # flash attention: one float32 log-sum-exp per query row, no scores
    full = elem * (8 * b * s * h + 2 * b * s * f + 4 * b * s) + core
    if mode == "selective":
        return full - core
    if mode == "block":
        return elem * b * s * h
    return full


def context_activation_bytes(b: int, s: int, h: int, elem: int, style: str, whole: int) -> int:
    """What context parallelism's attention keeps per block beyond the fused kernel's at s = this rank's tokens:
    both keep the attention's output in heads-first order, which the projection's input must copy (the kernel's
    output is laid out in token order, so its copy is free); Ulysses also keeps the two orders of the whole
    sequence's positions (int64)."""
    return b * s * h * elem + (2 * 8 * whole if style == "ulysses" else 0)


def _logits(inp: PlanInput) -> int:
    """Elements of the logits on this rank (b s V)."""
    return inp.micro_batch * local_seq(inp) * inp.model.vocab_size // inp.tp


def _loss_in_compute_dtype(inp: PlanInput) -> bool:
    """Mixed precision on CUDA: cross_entropy passes its input's dtype to the log-softmax, which CUDA autocast
    respects (its log-probabilities are 16-bit), and the NLL loss, on autocast's float32 list, keeps a float32 copy
    of them. The CPU's autocast runs the whole cross-entropy in float32. Not under
    tensor parallelism, whose vocabulary-parallel loss computes its softmax in float32 on any device."""
    return inp.precision != "fp32" and inp.hardware.device == "cuda" and inp.tp == 1


def logprob_bytes(inp: PlanInput) -> int:
    """What the loss keeps of its log-probabilities for backward: in float32 under the CPU's autocast, in the
    compute dtype plus the NLL loss's float32 copy under CUDA's (_loss_in_compute_dtype), in the compute dtype
    in full precision."""
    if _loss_in_compute_dtype(inp):
        return (element_bytes(inp.precision) + 4) * _logits(inp)
    return (4 if inp.precision != "fp32" else element_bytes(inp.precision)) * _logits(inp)


def replay_bytes(inp: PlanInput) -> int:
    """Block recomputation: the one layer replayed in backward holds a layer's whole activations for a while."""
    if inp.model is None or inp.activation_checkpointing != "block":
        return 0
    return layer_activation_bytes(inp.model, inp.micro_batch, element_bytes(inp.precision), "none", inp.cp,
                                  inp.cp_style) // inp.tp


def loss_backward_bytes(inp: PlanInput) -> int:
    """The loss's own backward, alive beside the log-probabilities while every layer's activations are still held:
    the NLL's gradient and the log-softmax's input gradient, each the float32 log-probabilities' size; under CUDA's
    autocast the NLL's float32 gradient only (its copy of the log-probabilities and that gradient are freed before
    the 16-bit log-softmax's backward runs). With GPT-2's vocabulary these are the largest tensors of the step."""
    if inp.model is None:
        return 0
    return 4 * _logits(inp) if _loss_in_compute_dtype(inp) else 2 * logprob_bytes(inp)


def activation_bytes(inp: PlanInput) -> int:
    """Peak activation bytes per rank: the stage's layers for every micro-batch in flight, the
    embedding and head around them, and under block recomputation one replayed layer."""
    cfg = inp.model
    if cfg is None:
        return 0
    b, s, h = inp.micro_batch, local_seq(inp), cfg.d_model
    elem = element_bytes(inp.precision)
    layers = math.ceil(cfg.n_layer / inp.pp)
    # 1F1B: stage 0 holds min(pp, M); zero-bubble: every stage as many, each until its W; GPipe: all M;
    # interleaved: stage 0's chunk micro-batches at its peak, each 1/V of the stage's layers.
    in_flight = inp.microbatches if inp.schedule == "gpipe" else min(inp.pp, inp.microbatches)
    if inp.schedule == "interleaved":
        in_flight = peak_in_flight(interleaved(inp.pp, inp.microbatches, inp.virtual_stages)[0]) / inp.virtual_stages
    per_microbatch = layers * layer_activation_bytes(cfg, b, elem, inp.activation_checkpointing, inp.cp,
                                                     inp.cp_style) // inp.tp
    # The token ids: inputs and targets one window of a loader's, or once cut for a context group two tensors.
    ids = 8 * b * (s + 1) if inp.cp == 1 else 16 * b * s
    ends = elem * (2 * b * s * h + 2 * b * s) + logprob_bytes(inp) + ids + 8 * s
    return round(in_flight * per_microbatch) + ends + replay_bytes(inp) + deferred_gradient_bytes(inp)


def deferred_gradient_bytes(inp: PlanInput) -> int:
    """Zero-bubble: between a micro-batch's B and its W the gradients of its layers' outputs wait (a block's: its two
    norms', q k v's, the projection's, the MLP's two; parallel/pipeline_parallel/zero_bubble.py), for as many
    micro-batches as a stage holds. An estimate: not yet checked against measurement."""
    if inp.schedule != "zero-bubble" or inp.model is None:
        return 0
    cfg, b, s = inp.model, inp.micro_batch, local_seq(inp)
    per_layer = element_bytes(inp.precision) * b * s * (7 * cfg.d_model + cfg.ffn_dim)
    return min(inp.pp, inp.microbatches) * math.ceil(cfg.n_layer / inp.pp) * per_layer


def offloaded_bytes(inp: PlanInput, state: dict[str, int]) -> tuple[int, int]:
    """(host bytes, disk bytes) of the model state kept off the device: offloaded, the optimizer's master and state
    in host memory (cpu) or files (disk), and at ZeRO-2/3 the gradient shard in host memory (ZeRO-Offload's
    layout; parallel/core/config.py)."""
    if inp.offload == "none":
        return 0, 0
    grads = state["grads"] if inp.zero >= 2 else 0
    if inp.offload == "cpu":
        return state["optimizer"] + grads, 0
    return grads, state["optimizer"]
