"""Time per step: FLOPs per token 6N + 12 L h s (Chowdhery et al., PaLM, appendix B; N all parameters, or a
mixture of experts' active ones), plus one more forward of what is recomputed, at the stated MFU; each collective
from the alpha-beta model t = alpha + factor x S / beta (ring: factor 2(N-1)/N for all-reduce, (N-1)/N for
all-gather and reduce-scatter); parameter servers' push and pull (servers.py). Communication is added to
compute (no overlap assumed: an upper bound); the pipeline bubble is the schedule's (predict.py:
(pp-1)/(m+pp-1), or zero-bubble's (pp-1)/(3m+pp-1)).
"""
from __future__ import annotations

import math

from . import servers
from .hardware import Link
from .inputs import PlanInput, element_bytes, layout_params, local_seq, reduce_bytes
from .memory import units_freed


def active_params(inp: PlanInput) -> float:
    """Parameters one token's forward multiplies by: every one for a dense model; in a mixture of experts its k
    experts' of each layer's E (their up and down matrices and biases), not all of them."""
    m = inp.model
    if m is None or not m.moe_experts:
        return inp.params
    per_expert = 2 * m.d_model * m.ffn_dim + m.ffn_dim + m.d_model
    return inp.params - m.n_layer * (m.moe_experts - m.moe_top_k) * per_expert


def flops_per_token(inp: PlanInput) -> tuple[float, float]:
    """(model FLOPs, FLOPs including recomputation) per token, whole model. A mixture of experts counts the
    parameters a token meets: all but the experts, and top_k of each layer's experts."""
    N = active_params(inp)
    L, h, s = (inp.model.n_layer, inp.model.d_model, inp.model.seq_len) if inp.model else (0, 0, 0)
    model = 6 * N + 12 * L * h * s
    extra = {"none": 0, "block": 2 * N + 4 * L * h * s, "selective": 4 * L * h * s}[inp.activation_checkpointing]
    return model, model + extra


def collective_time(link: Link, factor: float, size: float, calls: int = 1) -> float:
    return calls * link.alpha_s + factor * size / link.beta_Bps


def communication(inp: PlanInput) -> list[dict]:
    """Per step, per rank: data-parallel gradient and parameter traffic of the ZeRO stage, the
    tensor-parallel all-reduces and the pipeline sends; each with bytes moved and seconds."""
    hw, N, elem = inp.hardware, inp.dp * inp.cp, element_bytes(inp.precision)  # a context group's are replicas
    world = inp.dp * inp.tp * inp.pp * inp.cp
    dp_links = hw.intra if world <= hw.gpus_per_node else hw.inter
    units = (inp.model.n_layer + 4) if inp.model else 1  # blocks, embeddings, ln_f, head
    rows = []
    if inp.servers:
        link = server_link(inp)
        rows += servers.traffic(N, inp.servers, reduce_bytes(inp) * layout_params(inp), elem * layout_params(inp),
                                     link.alpha_s, link.beta_Bps)
    elif N > 1:
        grads, params = reduce_bytes(inp) * layout_params(inp), elem * layout_params(inp)  # the group's whole vectors
        syncs = inp.grad_accum if inp.zero >= 2 else 1  # ZeRO-2/3 reduce every micro-batch
        if inp.zero == 0:
            rows.append(_row("all_reduce gradients", dp_links, "all_reduce", 2 * (N - 1) / N, grads, syncs))
        else:
            calls = units if inp.zero >= 2 else 1
            rows.append(_row("reduce_scatter gradients", dp_links, "reduce_scatter", (N - 1) / N, grads, syncs,
                             calls))
            # ZeRO-3: before forward and before backward; ZeRO-2: after the update, and before each micro-batch's
            # forward after the first (the previous backward freed them)
            gathers = 2 * inp.grad_accum if inp.zero == 3 else inp.grad_accum if units_freed(inp) else 1
            rows.append(_row("all_gather parameters", dp_links, "all_gather", (N - 1) / N, params, gathers,
                             units if inp.zero >= 2 else 1))
    if inp.model and (inp.tp > 1 or inp.pp > 1):
        act = elem * inp.micro_batch * inp.model.seq_len * inp.model.d_model
        micro = inp.grad_accum * max(1, inp.microbatches)
        if inp.tp > 1:  # Megatron: 2 all-reduces per layer in forward (attention, MLP), 2 in backward
            count = 4 * math.ceil(inp.model.n_layer / inp.pp) * micro
            rows.append(_row("tensor-parallel all_reduce", hw.intra, "all_reduce", 2 * (inp.tp - 1) / inp.tp, act,
                             count))
        if inp.pp > 1:  # one activation forward and one gradient backward per micro-batch and stage boundary
            rows.append(_row("pipeline send/recv", hw.inter if world > hw.gpus_per_node else hw.intra, "send", 1.0,
                             act, 2 * micro))
    if inp.model and inp.model.moe_experts:
        rows += expert_rows(inp, dp_links, elem)
    if inp.model and inp.cp > 1:
        rows += context_rows(inp, hw.intra if world <= hw.gpus_per_node else hw.inter, elem)
    return rows


def context_rows(inp: PlanInput, links: dict[str, Link], elem: int) -> list[dict]:
    """Context parallelism's traffic per step and rank, every layer (parallel/context_parallel/). Ring: a forward
    passes this rank's keys and values on cp - 1 times; a backward passes them on with their gradients cp - 1
    times and the gradients home once (cp messages, 2 cp - 1 blocks of keys and values).
    Ulysses: four all-to-alls per layer and pass (q, k, v to a split of the heads, the output back), each moving
    (cp - 1) / cp of this rank's b s h. A forward recomputation replays the forward's."""
    m, N = inp.model, inp.cp
    forwards = inp.grad_accum * (2 if inp.activation_checkpointing != "none" else 1)
    layers, block = m.n_layer, inp.micro_batch * local_seq(inp) * m.d_model
    if inp.cp_style == "ring":
        pair = 2 * block * elem  # keys and values, or their gradients
        # A backward's N messages carry 2N - 1 pairs: N - 1 with the gradients beside them, then the gradients home.
        return [_row("ring send/recv (keys, values)", links, "send", 1.0, pair, layers * forwards * (N - 1)),
                _row("ring send/recv (backward, with gradients)", links, "send", 1.0, pair * (2 * N - 1) / N,
                     layers * inp.grad_accum * N)]
    return [_row("Ulysses all_to_all (heads <-> tokens)", links, "all_to_all", (N - 1) / N, elem * block,
                 layers * 4 * (forwards + inp.grad_accum))]


def expert_rows(inp: PlanInput, links: dict[str, Link], elem: int) -> list[dict]:
    """A mixture of experts' traffic per step and rank, every block's MLP a MoE layer. Expert parallelism, per
    layer and forward (parallel/expert_parallel/experts.py): the E row counts, then the routed rows out to their
    experts' ranks and back, all-to-all; backward the two row exchanges reversed. The global balancing loss
    (models/minigpt/moe.py): an all_reduce of E + 1 numbers per layer and forward over the ranks that split the
    batch. Activation checkpointing replays each forward in backward, with its collectives. The rows leaving a
    rank are (ep - 1) / ep of those it routes, as when the router spreads them evenly."""
    m = inp.model
    forwards = inp.grad_accum * max(1, inp.microbatches) * (2 if inp.activation_checkpointing != "none" else 1)
    backwards = inp.grad_accum * max(1, inp.microbatches)
    layers = math.ceil(m.n_layer / inp.pp)
    rows = []
    if inp.ep > 1:
        away = (inp.ep - 1) / inp.ep
        routed = elem * inp.micro_batch * m.seq_len * m.moe_top_k * m.d_model
        rows.append(_row("expert all_to_all (row counts)", links, "all_to_all", away, 8 * m.moe_experts,
                         layers * forwards))
        rows.append(_row("expert all_to_all (routed rows)", links, "all_to_all", away, routed,
                         layers * (2 * forwards + 2 * backwards)))
    if m.moe_balance == "global" and m.moe_aux_loss_coef and inp.dp > 1:
        rows.append(_row("MoE balance all_reduce (expert counts)", links, "all_reduce", 2 * (inp.dp - 1) / inp.dp,
                         8 * (m.moe_experts + 1), layers * forwards))
    return rows


def server_link(inp: PlanInput) -> Link:
    """The link a parameter server's pushes and pulls cross: within a node while workers and servers fit in one."""
    hw = inp.hardware
    return (hw.intra if inp.dp + inp.servers <= hw.gpus_per_node else hw.inter)["send"]


def _row(what: str, links: dict[str, Link], op: str, factor: float, size: float, times: int, calls: int = 1) -> dict:
    link = links[op]
    return {"what": what, "op": op, "bytes": int(factor * size * times), "seconds":
            times * collective_time(link, factor, size, calls), "calls": times * calls}
