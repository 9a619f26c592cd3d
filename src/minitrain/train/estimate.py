"""`minitrain plan`: will it fit, and how long will a step take, before anything is launched.

Memory per rank, by kind:
- parameters, gradients, optimizer state: the ZeRO memory math (`parallel.flat.memory_terms`,
  the same rule the strategies' memory profile checks). In fp32 the optimizer holds master, m
  and v (3 x 4 bytes/param; at ZeRO-3 the parameter shard is the master, so 2 x 4). In bf16/fp16
  (precision.py) parameters take 2 bytes, the optimizer K = 12 bytes/param (fp32 master, m, v),
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
  keeps one bsh input per layer plus one layer's full set (replayed in backward). A pipeline stage keeps its layers' activations for every micro-batch in flight:
  min(pp, micro-batches) under 1F1B, all of them under GPipe.
Time per step: FLOPs per token 6N + 12 L h s (Chowdhery et al., PaLM, appendix B; N all parameters),
plus one more forward of what is recomputed, at the stated MFU; each collective from the
alpha-beta model t = alpha + factor x S / beta (ring: factor 2(N-1)/N for all-reduce, (N-1)/N for
all-gather and reduce-scatter); pipeline bubble (pp-1)/(m+pp-1). Communication is added to
compute (no overlap assumed: an upper bound).

Tensor and pipeline parallel degrees divide the parameters evenly (P / (tp pp), an approximation:
LayerNorms are replicated under TP, and the first and last stages also hold the embedding and
head). Not checked against measurement: minitrain runs tensor parallelism, whose replicated
parameters this does not count, and has no pipeline stages yet.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from . import plan_servers
from .optim import FlatAdamW
from ..parallel.core.memory_math import memory_terms, padded_numel, term_bytes

GB = 1e9


@dataclass
class Link:
    alpha_s: float  # latency of one collective
    beta_Bps: float  # bus bandwidth


@dataclass
class Hardware:
    name: str
    memory_bytes: float
    peak_flops: dict[str, float]  # by precision, dense
    intra: dict[str, Link]  # by op: all_reduce, all_gather, reduce_scatter (and others from bench comm)
    inter: dict[str, Link]
    gpus_per_node: int = 8
    source: str = ""
    # What the optimizer's chunk size is chosen for (train/optim.py), and whose autocast the loss's terms follow.
    device: str = "cuda"


def _links(alpha_s: float, beta_Bps: float) -> dict[str, Link]:
    return {op: Link(alpha_s, beta_Bps) for op in ("all_reduce", "all_gather", "reduce_scatter", "send")}


# Datasheet peaks (dense); bus bandwidths are what NCCL's tests reach in practice, below the
# link's nominal rate (NVLink 3: 300 GB/s per direction, NVLink 4: 450; InfiniBand HDR 200 Gb/s,
# NDR 400 Gb/s per GPU).
PRESETS = {
    "a100-80g": Hardware("a100-80g", 80 * 2**30, {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12},
                         _links(15e-6, 230 * GB), _links(30e-6, 22 * GB),
                         source="A100 SXM 80GB datasheet; NVLink 3, HDR InfiniBand"),
    # ZeRO-Offload's machine (Ren et al. 2021): no bf16 units, so bf16 gets the fp32 rate at best.
    "v100-32g": Hardware("v100-32g", 32 * 2**30, {"fp32": 15.7e12, "bf16": 15.7e12, "fp16": 125e12},
                         _links(15e-6, 130 * GB), _links(30e-6, 11 * GB),
                         source="V100 SXM2 32GB datasheet; NVLink 2, EDR InfiniBand"),
    "h100-sxm": Hardware("h100-sxm", 80 * 2**30, {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12},
                         _links(15e-6, 360 * GB), _links(30e-6, 45 * GB),
                         source="H100 SXM5 datasheet; NVLink 4, NDR InfiniBand"),
}


def cpu_here(comm_json: str | Path) -> Hardware:
    """This machine: memory from /proc/meminfo, peak FLOP/s from a one-thread float32 matmul
    measured now, alpha and beta per op from `minitrain bench comm`'s comm.json."""
    path = Path(comm_json)
    try:
        ops = json.loads(path.read_text())["ops"]
    except FileNotFoundError:
        raise ConfigError(f"--hardware cpu-here needs {path}: run `minitrain bench comm --out {path.parent}` "
                          "first (or pass --comm-json)") from None
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot read {path} as `minitrain bench comm` output: {e}") from None
    links = {op: Link(r["alpha_s"], r["beta_Bps"]) for op, r in ops.items()}
    links.setdefault("send", links.get("broadcast", links["all_reduce"]))
    memory = 0.0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            memory = int(line.split()[1]) * 1024
    flops = measure_matmul_flops()
    return Hardware("cpu-here", memory, {"fp32": flops, "bf16": flops, "fp16": flops}, links, links,
                    gpus_per_node=1 << 30, source=f"measured: matmul now, collectives from {path}", device="cpu")


def measure_matmul_flops(n: int = 512, seconds: float = 0.3) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per rank, as minitrain runs
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        return 2 * n**3 * count / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


@dataclass
class PlanInput:
    model: ModelConfig | None  # None with a raw parameter count
    params: float  # parameter count (exact for a model config)
    seq_len: int = 1024  # tokens per example when only a parameter count is given
    micro_batch: int = 1
    grad_accum: int = 1
    precision: str = "fp32"
    reduce_dtype: str = "fp32"  # fp32 | compute: what gradients are summed in (precision.py)
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    activation_checkpointing: str = "none"
    microbatches: int = 1  # pipeline micro-batches per step
    schedule: str = "1f1b"
    offload: str = "none"  # none | cpu | disk: where the optimizer's master and state live (train/offload.py)
    ep: int = 1  # expert parallelism (a mixture of experts): each rank holds 1/ep of the experts; divides dp
    servers: int = 0  # parameter servers besides the dp workers (plan_servers.py); the workers hold no optimizer
    staleness: int = 0  # their bound K: what a server holds of gradients waiting for their step
    mfu: float = 0.4
    hardware: Hardware = field(default_factory=lambda: PRESETS["h100-sxm"])


def model_units(cfg: ModelConfig, ep: int = 1) -> dict[str, int]:
    """Parameter count of each unit ZeRO-2/3 move together (parallel/core/units.py), in layout order,
    from a model built on the meta device (no memory, no initialisation cost); with ep > 1 the units one
    expert-parallel rank holds (its 1/ep of each layer's experts: parallel/expert_parallel/experts.py)."""
    from ..models import spec_for
    from ..parallel.expert_parallel.experts import shard_experts
    from ..parallel.core.units import module_units
    from ..runtime.comm import Comm

    with torch.device("meta"):
        model = spec_for(cfg).build(cfg)
        if ep > 1:
            shard_experts(model, Comm(0, ep))  # rank 0's share: every rank's is the same size
    named = dict(model.named_parameters())
    return {plan.name: sum(named[n].numel() for n in plan.params) for plan in module_units(model)}


def model_params(cfg: ModelConfig) -> int:
    return sum(model_units(cfg).values())


def padded_params(cfg: ModelConfig, zero: int, dp: int, ep: int = 1) -> int:
    """P as the strategy lays it out: one unit at ZeRO 0-1, one per block at ZeRO 2-3, each padded to a
    multiple of the ranks it is sharded over (data parallel shards nothing and pads nothing)."""
    units = list(model_units(cfg, ep).values())
    return padded_numel(units if zero >= 2 else [sum(units)], dp if zero >= 1 else 1)


def layout_params(inp: PlanInput) -> int:
    """P: the flat size one model-parallel rank's data-parallel group shards (padded as laid out)."""
    if inp.model is not None and inp.tp == inp.pp == 1:
        return padded_params(inp.model, inp.zero, shard_ranks(inp), inp.ep)
    return math.ceil(inp.params / (inp.tp * inp.pp))


def shard_ranks(inp: PlanInput) -> int:
    """The ranks ZeRO shards over: the data-parallel ranks, or under expert parallelism the replicas of one
    rank's experts (dp / ep; Topology.with_experts)."""
    return inp.dp // inp.ep


def element_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def reduce_bytes(inp: PlanInput) -> int:
    """Bytes per gradient element on the wire (and in ZeRO-2/3's gradient shard)."""
    return 4 if inp.reduce_dtype == "fp32" else element_bytes(inp.precision)


def state_element_bytes(inp: PlanInput) -> dict[str, int]:
    """Bytes per element of each kind, as the strategies hold them (FlatStrategy.element_sizes)."""
    elem = element_bytes(inp.precision)
    return {"params": elem, "grads": reduce_bytes(inp) if inp.zero >= 2 else elem, "optimizer": 4}


def units_freed(inp: PlanInput) -> bool:
    """ZeRO-2 frees each unit's full parameters after backward, gathering them from the master: in full precision,
    not offloaded (Zero2Units.applies)."""
    return inp.zero == 2 and inp.precision == "fp32" and inp.offload == "none"


def model_state_bytes(inp: PlanInput) -> dict[str, int]:
    mixed, P, elem = inp.precision != "fp32", layout_params(inp), state_element_bytes(inp)
    out = {}
    # fp32 keeps a separate master except at ZeRO-2/3 (the parameter shard is the master, and ZeRO-2 frees its full
    # parameters after backward: zero2_units.py); mixed precision always does, and so does offload (the master goes
    # with the state, the shard stays with the model).
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
    parameters are freed when it has): the largest, three times. Measured on 4 ranks, that third
    unit is there in about half the steps, as the collective's completion falls. Other stages hold
    no full-size transient then. Without a model, no unit sizes are known: 0."""
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


def layer_activation_bytes(cfg: ModelConfig, b: int, elem: int, mode: str) -> int:
    """What one block keeps for backward (see the module docstring)."""
    s, h, a, f = cfg.seq_len, cfg.d_model, cfg.n_head, cfg.ffn_dim
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


def _logits(inp: PlanInput) -> int:
    """Elements of the logits on this rank (b s V)."""
    return inp.micro_batch * inp.model.seq_len * inp.model.vocab_size // inp.tp


def _loss_in_compute_dtype(inp: PlanInput) -> bool:
    """Mixed precision on CUDA: cross_entropy passes its input's dtype to the log-softmax, which CUDA autocast
    respects (its log-probabilities are 16-bit), and the NLL loss, on autocast's float32 list, keeps a float32 copy
    of them. The CPU's autocast runs the whole cross-entropy in float32. Measured on an H100 (gpt2-124m, 8 x 1024
    tokens): bf16 log-probabilities, their float32 copy and the NLL's float32 gradient at the loss's peak. Not under
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
    return layer_activation_bytes(inp.model, inp.micro_batch, element_bytes(inp.precision), "none") // inp.tp


def loss_backward_bytes(inp: PlanInput) -> int:
    """The loss's own backward, alive beside the log-probabilities while every layer's activations are still held:
    the NLL's gradient and the log-softmax's input gradient, each the float32 log-probabilities' size; under CUDA's
    autocast the NLL's float32 gradient only (its copy of the log-probabilities and that gradient are freed before
    the 16-bit log-softmax's backward runs). With GPT-2's vocabulary these are the largest tensors of the step
    (1.6 GB each at 8 x 1024 tokens)."""
    if inp.model is None:
        return 0
    return 4 * _logits(inp) if _loss_in_compute_dtype(inp) else 2 * logprob_bytes(inp)


def activation_bytes(inp: PlanInput) -> int:
    """Peak activation bytes per rank: the stage's layers for every micro-batch in flight, the
    embedding and head around them, and under block recomputation one replayed layer."""
    cfg = inp.model
    if cfg is None:
        return 0
    b, s, h = inp.micro_batch, cfg.seq_len, cfg.d_model
    elem = element_bytes(inp.precision)
    layers = math.ceil(cfg.n_layer / inp.pp)
    in_flight = min(inp.pp, inp.microbatches) if inp.schedule == "1f1b" else inp.microbatches
    per_microbatch = layers * layer_activation_bytes(cfg, b, elem, inp.activation_checkpointing) // inp.tp
    ends = elem * (2 * b * s * h + 2 * b * s) + logprob_bytes(inp) + 8 * b * (s + 1) + 8 * s
    return in_flight * per_microbatch + ends + replay_bytes(inp)


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
    hw, N, elem = inp.hardware, inp.dp, element_bytes(inp.precision)
    world = inp.dp * inp.tp * inp.pp
    dp_links = hw.intra if world <= hw.gpus_per_node else hw.inter
    units = (inp.model.n_layer + 4) if inp.model else 1  # blocks, embeddings, ln_f, head
    rows = []
    if inp.servers:
        link = _server_link(inp)
        rows += plan_servers.traffic(N, inp.servers, reduce_bytes(inp) * layout_params(inp), elem * layout_params(inp),
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
    return rows


def _server_link(inp: PlanInput) -> Link:
    """The link a parameter server's pushes and pulls cross: within a node while workers and servers fit in one."""
    hw = inp.hardware
    return (hw.intra if inp.dp + inp.servers <= hw.gpus_per_node else hw.inter)["send"]


def _row(what: str, links: dict[str, Link], op: str, factor: float, size: float, times: int, calls: int = 1) -> dict:
    link = links[op]
    return {"what": what, "op": op, "bytes": int(factor * size * times), "seconds":
            times * collective_time(link, factor, size, calls), "calls": times * calls}


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


def plan(inp: PlanInput) -> dict:
    state = model_state_bytes(inp)
    acts, gathered = activation_bytes(inp), gathered_bytes(inp)
    in_backward, in_update = update_transients(inp)
    loss_grads = loss_backward_bytes(inp)
    # The peak is the largest of three moments: the loss's backward (forward's activations all alive, the
    # log-probabilities' gradients beside them; no layer replayed and no gradient reduced yet), the layers'
    # backward (a layer replayed, the gradient sync's float32 copy begun) and the update. Before the loss's moment
    # was counted, the plan fell 26-39% short of an H200's max_memory_allocated on gpt2-124m (8 x 1024 tokens).
    transient = max(gathered + acts - replay_bytes(inp) + loss_grads, gathered + acts + in_backward, in_update)
    host, disk = offloaded_bytes(inp, state)
    total = sum(state.values()) - host - disk + transient
    hw = inp.hardware
    seq = inp.model.seq_len if inp.model else inp.seq_len
    tokens_rank = inp.micro_batch * seq * inp.grad_accum * max(1, inp.microbatches)
    model_fpt, hw_fpt = flops_per_token(inp)
    flops_rank = hw_fpt * tokens_rank / (inp.tp * inp.pp)
    peak = hw.peak_flops[inp.precision]
    compute_s = flops_rank / (peak * inp.mfu)
    bubble = (inp.pp - 1) / (inp.microbatches + inp.pp - 1) if inp.pp > 1 else 0.0
    comm = communication(inp)
    comm_s = sum(r["seconds"] for r in comm)
    step_s = compute_s / (1 - bubble) + comm_s
    global_tokens = tokens_rank * inp.dp
    servers = None
    if inp.servers:
        P, elem = layout_params(inp), element_bytes(inp.precision)
        link = _server_link(inp)
        servers = plan_servers.summary(inp.dp, inp.servers, inp.staleness, P, reduce_bytes(inp) * P, elem * P, elem,
                                       reduce_bytes(inp), link.alpha_s, link.beta_Bps)
    return {
        "input": {k: v for k, v in asdict(inp).items() if k not in ("model", "hardware")}
        | {"model": None if inp.model is None else asdict(inp.model), "hardware": hw.name},
        "world_size": inp.dp * inp.tp * inp.pp + inp.servers,
        "parameter_servers": servers,
        # total is the predicted peak: state at rest plus the largest of the three moments above
        "bytes_per_rank": {**state, "gathered": gathered, "activations": acts, "loss_backward": loss_grads,
                           "reduce_copy": in_backward,
                           "update": in_update, "total": total,
                           "host": host, "disk": disk},
        "device_memory_bytes": hw.memory_bytes,
        "fits": total <= hw.memory_bytes,
        "flops_per_token": model_fpt, "flops_per_token_with_recompute": hw_fpt,
        "flops_per_rank_step": flops_rank, "peak_flops": peak, "mfu": inp.mfu,
        "compute_s": compute_s, "pipeline_bubble": bubble, "communication": comm, "communication_s": comm_s,
        "step_s": step_s, "tokens_per_step": global_tokens, "tokens_per_s": global_tokens / step_s,
        "hardware_source": hw.source,
    }


def render(result: dict) -> str:
    """The plan as text."""
    from .metrics import format_table, human_bytes

    inp, b = result["input"], result["bytes_per_rank"]
    kinds = ("params", "grads", "optimizer", "gathered", "activations", "loss_backward", "reduce_copy", "update",
             "total")
    rows = [[kind, human_bytes(b[kind]), f"{b[kind] / GB:.3f}"] for kind in kinds]
    if inp["offload"] != "none":  # rows of state off the device say where it is, and are not in the device's total
        rows[kinds.index("optimizer")][0] = f"optimizer ({'host' if inp['offload'] == 'cpu' else 'disk'})"
        if inp["zero"] >= 2:
            rows[kinds.index("grads")][0] = "grads (host)"
        rows += [[f"{where}, off the device", human_bytes(b[where]), f"{b[where] / GB:.3f}"]
                 for where in ("host", "disk") if b[where]]
    memory = human_bytes(result["device_memory_bytes"])
    experts = f" (ep {inp['ep']}: 1/{inp['ep']} of the experts per rank)" if inp.get("ep", 1) > 1 else ""
    lines = [f"Plan: {result['world_size']} rank(s) = dp {inp['dp']} x tp {inp['tp']} x pp {inp['pp']}{experts}, "
             f"ZeRO-{inp['zero']}, "
             f"{inp['precision']}, micro-batch {inp['micro_batch']}, activation checkpointing "
             f"{inp['activation_checkpointing']}, on {inp['hardware']}",
             "", "Memory per rank", format_table(["kind", "bytes", "GB"], rows, "<>>"),
             f"total {human_bytes(b['total'])} of {memory}: " + ("fits" if result["fits"] else "DOES NOT FIT"),
             "", f"FLOPs per token {result['flops_per_token']:.4g} (with recomputation "
             f"{result['flops_per_token_with_recompute']:.4g}); per rank per step {result['flops_per_rank_step']:.4g}",
             f"compute {1e3 * result['compute_s']:.2f} ms at {100 * result['mfu']:.0f}% MFU of "
             f"{result['peak_flops'] / 1e12:.4g} TFLOP/s; pipeline bubble {100 * result['pipeline_bubble']:.1f}%"]
    if result["communication"]:
        comm = [[r["what"], r["calls"], human_bytes(r["bytes"]), f"{1e3 * r['seconds']:.2f}"]
                for r in result["communication"]]
        lines += ["", "Communication per step (alpha-beta model, no overlap assumed)",
                  format_table(["collective", "calls", "bus bytes", "ms"], comm, "<>>>")]
    if result.get("parameter_servers"):
        lines += plan_servers.render(result["parameter_servers"], human_bytes)
    lines += ["", f"step {1e3 * result['step_s']:.2f} ms, {result['tokens_per_step']:,} tokens/step, "
                  f"{result['tokens_per_s']:,.0f} tokens/s"]
    return "\n".join(lines)
