"""prepare(model, optimizer, ...): the user's model made to train under minitrain's strategies, in place.
Every argument is checked before any rank splits or moves anything, so a refusal leaves the model as it was."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys

import torch
from torch import nn

from ..parallel import ModelPlan, cast_parameters, parallelize
from ..parallel.core.config import ParallelConfig
from ..parallel.expert_parallel.experts import HuggingFaceExperts, hugging_face_experts, routes_its_own_tokens
from ..parallel.context_parallel.layout import ContextLayout
from .moe_stats import moe_counters
from ..parallel.core.loss_scale import COMPUTE_DTYPES
from ..parallel.core.offload import OffloadStore
from ..parallel.pipeline_parallel.split import PipelineSplit, Stage, split_model
from ..parallel.pipeline_parallel.executor import Pipeline
from ..parallel.user_loop.replica_state import refuse_batch_statistics
from ..parallel.core.shard_optimizer import (ZERO_SHARDS, OptimizerFn, TorchShardOptimizer, check_elementwise,
                                        check_optimizer_fn)
from ..parallel.tensor_parallel.plans import check_plan, hugging_face_plan
from ..parallel.state.whole_state import check_one_count_per_group, load_optimizer_state
from ..runtime.topology import Topology
from . import user_optimizer
from .ddp_idioms import adopt, follow_sync_requests
from .optimizer import PreparedOptimizer
from .servers import ServerRankOptimizer, check_server_settings, make_server, split_world
from .session import Prepared, current, held_apart
from .context import check_context_inputs, context_plan
from .pipeline import pipeline_split
from .steps import note_feed


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerFn, *, zero: int = 0,
            param_groups: list[dict] | None = None,
            precision: str = "fp32", reduce_dtype: str = "fp32", dp: str = "bucketed", bucket_mb: float = 25.0,
            prefetch: bool = True, activation_checkpointing: str | type = "none", tp: int = 1,
            tp_plan: dict | str | None = None, pp: int = 1, pp_split: PipelineSplit | list | str | None = None,
            microbatches: int = 1, schedule: str = "1f1b", virtual_stages: int | None = None, offload: str = "none",
            offload_dir: str | None = None, ep: int = 1, ep_plan: dict | str | None = None, cp: int = 1,
            cp_style: str = "ring", cp_plan: str | None = None, plan: ModelPlan | None = None, servers: int = 0,
            staleness: int = 0) -> tuple[nn.Module, PreparedOptimizer | ServerRankOptimizer]:
    """Make `model` train data parallel over every rank (ZeRO stage `zero`), with the user's optimizer,
    and with tp > 1 its layers split over groups of tp adjacent ranks (tensor parallel, Megatron-style).

    optimizer: the optimizer you made over the model's parameters, as a DDP script has it where it wraps the model
        (any torch optimizer: its class, defaults, param groups and any state it holds, loaded from a checkpoint or
        stepped, carry over exactly; api/user_optimizer.py), or what makes one, called like a torch optimizer
        class on param groups, e.g. functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1). Under ZeRO
        (zero >= 1) it runs on this rank's shard, which is exact for elementwise optimizers (checked; others
        are refused).
    param_groups (with a maker only): [{"params": [parameters of model], **options}, ...] as you would give the
        optimizer (e.g. no weight decay for biases and norms); every trainable parameter in exactly one group.
        Default: one group of every trainable parameter. Frozen parameters (requires_grad=False) are
        never updated and hold no gradient or optimizer state.
    precision: fp32 (compute in the parameters' dtype, float32 or float64), bf16 (bfloat16 parameters
        and forward under autocast, float32 master weights and optimizer state) or fp16 (the same in float16,
        with the loss scaled by minitrain.GradScaler(optimizer), which the loop calls as torch.amp.GradScaler).
        reduce_dtype: fp32 or compute, what 16-bit gradients are summed in. dp (zero=0): bucketed (all-reduce
        overlapped with backward) or naive. bucket_mb: bucket cap. prefetch (zero=3): gather the next block early.
    activation_checkpointing: none | block (recompute each layer of the model's ModuleList/ModuleDict in
        backward) | selective (needs a plan naming what to recompute) | a module-name pattern such as
        "model.layers.*" | a module class such as LlamaDecoderLayer: those modules are recomputed.
    tp: tensor-parallel degree (must divide the world size; data parallel runs over world / tp replicas:
        feed each the slice of the batch dp_rank() / dp_world_size() say, the same on every rank of a
        tensor-parallel group). tp_plan: {module-name pattern: style} (parallel/tensor_parallel/plans.py lists the
        styles), or "auto" for a Hugging Face model's own plan (its config's base_model_tp_plan and the
        head's entry, so `model(...).logits` stays whole).
    pp: pipeline stages (pipeline parallel outermost: dp = world / (tp x pp)); the model is then cut into
        stages by pp_split (a PipelineSplit, the ordered names of its pieces, or "auto" for a Hugging Face
        model's own pipeline plan) and trained by minitrain.pipeline_step(model, inputs, targets, loss_fn)
        instead of forward + backward; each batch is cut into `microbatches` run by `schedule` (1f1b | gpipe |
        zero-bubble | interleaved: each rank holds virtual_stages chunks of the blocks, default 2).
    offload: none | cpu (the master weights and the optimizer's elementwise state in host memory) | disk (in
        memory-mapped files under offload_dir, one per tensor and rank, removed by cleanup()); the same numbers
        as without, bit for bit.
    ep: expert-parallel degree of a mixture of experts (tp = pp = 1; ep divides the world and the experts):
        groups of ep adjacent ranks each hold and compute 1/ep of every expert layer's experts, tokens sent to
        them and back by all-to-all; every rank reads its own share of the batch (dp_rank(), dp_world_size()
        count every rank then); the results are data parallelism's over all of them. Which layers: MiniGPT's own, found by type, or
        ep_plan: "auto" for a Hugging Face model's (its config's base_model_ep_plan: Mixtral, Qwen2-MoE, OLMoE),
        or {module-name pattern: "experts"} for a model's own modules of that layout (gate_up_proj (E, 2F, D),
        down_proj (E, D, F), act_fn; called with (hidden_states, top_k_index, top_k_weights)).
    cp: context-parallel degree (tp = pp = ep = 1; cp divides the world): groups of cp adjacent ranks split every
        sequence, each holding two chunks of 2 x cp (one early, one late); attention sees the whole sequence by
        cp_style (ring | ulysses: cp must divide the heads); the ranks of a group read the same sequences
        (dp_rank() / dp_world_size() count the groups) and the loop gives the model this rank's tokens:
        `inputs, targets = minitrain.context_shard(model, inputs, targets)` (targets already shifted). Which
        attention: the plan's (plan.attention and plan.positions), or cp_plan="auto" (the default without them)
        for a Hugging Face model with rotary positions (Llama, Mistral, Qwen). Causal masks only.
    servers: parameter servers (api/servers.py): the last `servers` ranks hold the parameters and run the user's
        optimizer on their shards (minitrain.is_server() there: call minitrain.serve()); the other ranks are
        workers, each feeding its own share of the batch (dp_rank() / dp_world_size() count workers), whose
        optimizer.step() pushes the gradient and pulls the updated parameters. staleness: K, how many steps a
        worker may run ahead of the slowest (0: synchronous, data parallel's result bit for bit). gloo only; zero,
        tp, pp, ep and offload stay at their defaults; an elementwise optimizer (it runs on shards).
    Returns (model, optimizer): the same model object (with DDP's and FSDP2's methods: api/ddp_idioms.py), and the
    optimizer to call step()/zero_grad() on, whose param_groups are yours. Every rank starts from rank 0's
    parameters and buffers, as DDP's does, however each rank made the model."""
    session = current()
    master = _check_arguments(model, session, zero, precision, reduce_dtype, dp)
    taken = user_optimizer.take(optimizer, param_groups) if isinstance(optimizer, torch.optim.Optimizer) else None
    optimizer_fn, param_groups = (taken.maker, taken.groups) if taken else (optimizer, param_groups)
    if taken and servers and user_optimizer.stepped(taken):
        raise ValueError("with parameter servers the optimizer's state lives on the servers, which start it afresh: "
                         "give prepare an optimizer that has not stepped or loaded state")
    check_server_settings(servers, staleness, session.topo.world_size, session.topo.backend, precision,
                          {"zero": zero, "tp": tp, "pp": pp, "ep": ep, "offload": offload, "dp": dp})
    _check_degrees(session.topo.world_size, tp, tp_plan, pp, pp_split)
    cp_plan = context_plan(model, plan, cp, cp_style, cp_plan, {"tp": tp, "pp": pp, "ep": ep, "servers": servers},
                            session.topo.world_size)
    _check_experts_alone(model, tp, pp)
    plan = _with_tp_plan(model, plan, tp, tp_plan)
    split, virtual = pipeline_split(model, pp, pp_split, microbatches, schedule, virtual_stages,
                                    {"tp": tp, "zero": zero, "activation_checkpointing": activation_checkpointing})
    if split is not None:
        plan = dataclasses.replace(plan or ModelPlan(),
                                   pipeline_split=lambda m, stage, stages: split_model(m, split, stage, stages, virtual))
    if offload not in ("none", "cpu", "disk"):
        raise ValueError(f"offload must be none, cpu or disk, got {offload!r}")
    experts = _expert_layers(model, ep, ep_plan, tp, pp, session.topo.world_size)
    counters = moe_counters(model, ep_plan)  # before any rank splits the experts
    if offload == "disk" and not offload_dir:
        raise ValueError("offload='disk' needs offload_dir: the directory for this rank's state files")
    groups = _named_groups(model, param_groups)
    check_optimizer_fn(optimizer_fn, groups[0][1] if groups else {})
    sharded = zero >= 1 or servers > 0  # the optimizer runs on shards: ZeRO's, or each server's
    # Tensor and expert parallelism give it slices of the parameters even at ZeRO-0.
    cut = ZERO_SHARDS if sharded else ("it cannot run on the slices tensor or expert parallelism gives each rank",
                                        "use tp=1 and ep=1 for it")
    if sharded or tp > 1 or ep > 1:
        for _, options in groups:
            check_elementwise(optimizer_fn, options, cut)
    if sharded and taken and taken.state:  # a state it could not hold exactly, said before anything changes
        trained = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        check_one_count_per_group(taken.state, trained, dict(enumerate(n for names, _ in groups for n in names)))
    # Checked: from here on the model is changed.
    topo = _on_models_device(session.topo, model)
    compute = COMPUTE_DTYPES[precision] if precision != "fp32" else master
    hooks = [] if precision == "fp32" else _forward_under_autocast(model, topo.device, compute)
    if precision != "fp32":
        cast_parameters(model, compute)
    # Full precision reduces in the parameters' own dtype; 16-bit in float32 or in the compute dtype.
    reduce = master if precision == "fp32" else torch.float32 if reduce_dtype == "fp32" else compute
    # Offloaded, the master is a copy kept where the store keeps it, not the parameters themselves.
    pcfg = ParallelConfig(zero=zero, dp=dp, bucket_mb=bucket_mb, prefetch=prefetch, master_dtype=master,
                          reduce_dtype=reduce, master_is_params=offload == "none", user_loop=True,
                          offload=offload)
    store = None if offload == "none" else OffloadStore(offload, offload_dir or "", topo.rank)

    # The param groups the user sees (optimizer.param_groups): theirs, over the model's parameters once it is split.
    shown = taken.groups if taken else [dict(options) for _, options in groups]

    def make_optimizer(master_vec, flat, shard_ranges, shown=shown):
        return TorchShardOptimizer(master_vec, flat, shard_ranges, sharded, optimizer_fn, groups, store, shown)

    # Expert parallelism: groups of ep ranks each hold and compute their share of the experts, the ranks holding
    # the same experts are the data-parallel group, and every rank reads its own data (dp_rank()).
    layout = topo.with_layout(tp, pp).with_experts(ep).with_context(cp)
    if servers:  # a server holds its shard and the user's optimizer; a worker trains with its topology
        group, layout = split_world(layout, servers, staleness)
        if layout is None:
            # (A server's groups are its own: each push sets their learning rates.)
            session.server = make_server(model, group, pcfg, functools.partial(make_optimizer, shown=None))
            session.serving = True
            session.layout = None
            return model, ServerRankOptimizer()
    builder = None if split is None else functools.partial(
        Pipeline, comm=layout.pp, schedule=schedule, microbatches=microbatches, d_model=0, dtype=compute,
        device=topo.device, forward_context=functools.partial(_autocast, topo.device, precision), virtual=virtual,
        measure=False)  # (no bubble to report in a loop of the user's own)
    strategy, pipeline = parallelize(model, layout, pcfg, make_optimizer, plan, activation_checkpointing,
                                     None if builder is None else lambda s, _chunks: builder(s.module, no_sync=s.no_sync),
                                     ep_plan=ep_plan if experts else None, cp_style=cp_style, cp_plan=cp_plan)
    settings = {"zero": zero, "precision": precision, "reduce_dtype": reduce_dtype, "dp": dp, "bucket_mb": bucket_mb,
                "prefetch": prefetch, "tp": tp, "pp": pp, "microbatches": microbatches, "schedule": schedule,
                "virtual_stages": virtual,
                "offload": offload, "ep": ep, "cp": cp, "cp_style": cp_style, "servers": servers,
                "staleness": staleness,
                "activation_checkpointing": getattr(activation_checkpointing, "__name__", activation_checkpointing)}
    stage = None if split is None else Stage(model, split, layout.pp.rank, pp, virtual)
    names = [group_names for group_names, _ in groups]
    state = Prepared(strategy, settings, layout, pipeline, stage, groups=names,
                     hooks=hooks + refuse_batch_statistics(model, layout.dp.world_size), offload=store,
                     user_class=type(model), moe=counters,
                     context=ContextLayout(layout.cp.rank, cp) if cp > 1 else None)
    state.hooks.extend(counters.handles if counters else [])
    if tp > 1 and split is None:  # a tensor-parallel group must be fed alike: checked at each step
        state.hooks.append(model.register_forward_pre_hook(
            lambda _m, args, kwargs: note_feed(state, (args, kwargs)), with_kwargs=True))
    state.hooks.append(follow_sync_requests(model, state))
    if cp > 1:  # the model takes this rank's tokens, and nothing the split would make wrong
        state.hooks.append(model.register_forward_pre_hook(functools.partial(check_context_inputs, state),
                                                           with_kwargs=True))
    if (tp > 1 and split is None) or ep > 1 or cp > 1:  # every forward is collective: an evaluation announces itself
        state.hooks.append(model.register_forward_pre_hook(
            torch.compiler.disable(functools.partial(_announce_evaluation, state))))  # eager under torch.compile
    if servers:
        # A worker's optimizer steps on the servers: here the user's class over the model's param groups holds only
        # what a scheduler sets (never stepped, so no state), and each push carries its learning rates.
        shadow = taken.source if taken else optimizer_fn(_torch_groups(model, groups))
    else:
        shadow = None
        user_optimizer.show(shown, names, dict(model.named_parameters()))
        if taken and taken.state:  # loaded (or stepped) before prepare: into this rank's shard, as a load would
            load_optimizer_state(strategy, names, taken.state)
    state.optimizer = PreparedOptimizer(strategy, state, shadow)
    if taken:  # its step hooks go with it (an EMA after each step, say)
        for mine, theirs in zip((state.optimizer._optimizer_step_pre_hooks, state.optimizer._optimizer_step_post_hooks),
                                taken.step_hooks()):
            mine.update(theirs)
        user_optimizer.retire(taken.source)
    adopt(model)
    session.layout = layout
    session.prepared[model] = state
    return model, state.optimizer


def _announce_evaluation(state: Prepared, _model, _args) -> None:
    """A forward without gradients (an evaluation, which a DDP script runs on rank 0 alone) of a model split over
    ranks waits for every rank to come (runtime/arrival.py), so a rank alone in it is stopped naming its line
    rather than its collectives pairing with the other ranks'. A training forward announces nothing."""
    if not torch.is_grad_enabled():
        apart = held_apart(state) or f"with cp={state.settings['cp']} each rank holds part of every sequence"
        current().arrive(state.topo.everyone, "the model's forward",
                         f"{apart}, which every forward combines with the other ranks': run the model on "
                         "every rank (an evaluation too), and use the result on one")


def _compiled(model: nn.Module) -> bool:
    """Whether `model` is what torch.compile returns (without importing torch.compile's machinery, which a compiled
    model has imported already)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def _check_arguments(model, session, zero, precision: str, reduce_dtype: str, dp: str) -> torch.dtype:
    """The model and the plain settings, checked; returns the dtype of the master weights (the trainable
    parameters' own)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare needs an nn.Module, got {type(model).__name__}")
    if not isinstance(zero, int) or isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be one of the ZeRO stages 0, 1, 2, 3; got {zero!r}")
    if model in session.prepared:
        raise ValueError(f"this {type(model).__name__} was already prepared; prepare a model once")
    if _compiled(model):
        raise ValueError("prepare takes the model before torch.compile: `model, optimizer = minitrain.prepare(model, "
                         "optimizer)`, then `model = torch.compile(model)`")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    if reduce_dtype not in ("fp32", "compute"):
        raise ValueError(f"reduce_dtype must be fp32 or compute, got {reduce_dtype!r}")
    if dp == "torch":
        raise ValueError("dp='torch' wraps the model in DistributedDataParallel; use wrap_for_ddp(model) for that")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    dtypes = {p.dtype for p in trainable}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"trainable parameters must share one floating dtype; found {sorted(map(str, dtypes))}")
    master = next(iter(dtypes))
    if precision != "fp32" and master != torch.float32:
        raise ValueError(f"precision={precision!r} keeps float32 master weights: give a float32 model, not {master}")
    return master


def _on_models_device(topo: Topology, model: nn.Module) -> Topology:
    """One process: the model stays on the device the user put it on (a CUDA model is not moved to the CPU), and
    the topology computes there. Several ranks: the model goes to this rank's device (its local rank's GPU under
    NCCL)."""
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if len(devices) > 1:
        raise ValueError(f"{type(model).__name__} is spread over {sorted(map(str, devices))}; put it on one device "
                         "before prepare (each rank holds its part on its own device)")
    device = devices.pop()
    if topo.world_size == 1 and topo.backend == "none":
        return topo if device == topo.device else Topology.single(device)
    if device != topo.device:
        model.to(topo.device)
    return topo


def _check_degrees(world: int, tp, tp_plan, pp, pp_split) -> None:
    """tp and pp are positive and their product divides the world (the rest is data parallel); a plan for a
    degree of 1 is a mistake worth saying."""
    for name, degree in (("tp", tp), ("pp", pp)):
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            raise ValueError(f"{name} must be a positive integer, got {degree!r}")
    if world % (tp * pp):
        raise ValueError(f"tp x pp = {tp} x {pp} does not divide the world size {world}; data parallel runs over "
                         "world / (tp x pp) replicas")
    for name, degree, given in (("tp", tp, tp_plan), ("pp", pp, pp_split)):
        if degree == 1 and given is not None:
            raise ValueError(f"{'tp_plan' if name == 'tp' else 'pp_split'} is given but {name}=1: nothing would be "
                             f"split; pass {name}=2 or more")


def _check_experts_alone(model: nn.Module, tp: int, pp: int) -> None:
    """A mixture of experts trains with data parallelism, ZeRO and ep only (docs/moe.md says why)."""
    routing = next((m for m in model.modules() if routes_its_own_tokens(m)), None)
    if routing is not None and (tp > 1 or pp > 1):
        raise ValueError(f"tp={tp}, pp={pp} with {type(routing).__name__}, a mixture of experts: tensor "
                         "parallelism does not split its 3-D expert weights, and a pipeline stage before the last "
                         "would drop its layers' balancing loss; use data parallelism, ZeRO and ep")


def _expert_layers(model: nn.Module, ep: int, ep_plan, tp: int, pp: int, world: int) -> list[nn.Module]:
    """The mixture-of-experts layers expert parallelism spreads (none at ep = 1), checked; ValueError saying why
    not otherwise."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep must be an integer >= 1, got {ep!r}")
    if ep == 1:
        return []
    if tp > 1 or pp > 1:
        raise ValueError(f"ep={ep} with tp={tp}, pp={pp}: expert parallelism runs over data-parallel ranks only")
    if world % ep:
        raise ValueError(f"ep={ep} does not divide the world size {world}")
    layers = hugging_face_experts(model, ep_plan) if ep_plan is not None else \
        [m for m in model.modules() if routes_its_own_tokens(m)]
    if not layers:
        raise ValueError(f"ep={ep} spreads a mixture of experts' experts, and {type(model).__name__} has no MoE "
                         "layer minitrain knows; give ep_plan ('auto' for a Hugging Face MoE model)")
    for layer in layers:
        count = layer.experts if routes_its_own_tokens(layer) else HuggingFaceExperts(layer).experts
        if count % ep:
            raise ValueError(f"ep={ep} does not divide the {count} experts of {type(layer).__name__}")
    return layers


def _with_tp_plan(model: nn.Module, plan: ModelPlan | None, tp: int, tp_plan) -> ModelPlan | None:
    """The model plan with the tensor-parallel plan prepare was given (checked before any rank splits)."""
    if tp == 1:
        return plan
    if tp_plan is None:
        if plan is not None and plan.tensor_parallel:
            return plan
        raise ValueError(f"tp={tp} needs tp_plan: {{module-name pattern: style}}, or 'auto' for a Hugging Face "
                         "model's own plan")
    if plan is not None and plan.tensor_parallel:
        raise ValueError("give the tensor-parallel plan once: as tp_plan or in plan.tensor_parallel, not both")
    if tp_plan == "auto":
        tp_plan = hugging_face_plan(model)
    elif not isinstance(tp_plan, dict):
        raise ValueError(f"tp_plan must be a dict of module-name pattern to style, or 'auto'; got {tp_plan!r}")
    check_plan(model, tp_plan, tp)  # a pattern matching nothing, an unknown style, a module it cannot split: said
    # before any group is made
    return dataclasses.replace(plan or ModelPlan(), tensor_parallel=tp_plan)


def _torch_groups(model: nn.Module, groups: list[tuple[list[str], dict]]) -> list[dict]:
    """The param groups as a torch optimizer takes them, over the model's own parameters."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [{"params": [params[name] for name in names], **options} for names, options in groups]


def _named_groups(model: nn.Module, param_groups: list[dict] | None) -> list[tuple[list[str], dict]]:
    """[(canonical names of a group's parameters, its options)], checked: every trainable parameter once. A frozen
    one may be in a group too, as a torch optimizer takes it (model.parameters()): it keeps its place (its index in
    optimizer.state_dict()), and is never updated and holds no state, as in torch, where it never has a gradient."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if param_groups is None:
        return [([canonical[i] for i in canonical if i in trainable], {})]
    seen: dict[int, int] = {}
    groups = []
    for g, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError("param_groups must be a list of dicts with a 'params' list, as torch optimizers take")
        names = []
        for p in group["params"]:
            name = canonical.get(id(p))
            if name is None:
                raise ValueError(f"param_groups[{g}] holds a tensor that is not a parameter of the model")
            if id(p) in seen:
                raise ValueError(f"'{name}' is in param_groups[{seen[id(p)]}] and param_groups[{g}]")
            seen[id(p)] = g
            names.append(name)
        groups.append((names, {k: v for k, v in group.items() if k not in user_optimizer.NOT_OPTIONS}))
    missing = [canonical[i] for i in trainable if i not in seen]
    if missing:
        raise ValueError(f"trainable parameter(s) {', '.join(missing[:5])} are in no param group; add them to one "
                         "or freeze them with requires_grad_(False)")
    return groups


def _autocast(device: torch.device, precision: str):
    """The forward context of a pipeline stage: autocast in bf16, nothing in full precision."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=COMPUTE_DTYPES[precision])


def _forward_under_autocast(model: nn.Module, device: torch.device, dtype: torch.dtype) -> list:
    """Run the model's forward under autocast (hooks around the call: the model object stays the user's); returns
    the hooks' handles."""
    contexts: list = []

    def enter(_module, _args):
        contexts.append(torch.autocast(device.type, dtype=dtype))
        contexts[-1].__enter__()

    def leave(_module, _args, _output):
        contexts.pop().__exit__(None, None, None)

    return [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
