"""The public API: your model, your optimizer, your loop; minitrain's strategies underneath.

    rank, world = minitrain.init_distributed()
    model, optimizer = minitrain.prepare(model, functools.partial(torch.optim.AdamW, lr=1e-3), zero=2)
    for x, y in batches:                      # this rank's share of the global batch
        loss = loss_fn(model(x), y)
        loss.backward()                       # gradients are averaged over the ranks for you
        minitrain.clip_grad_norm_(model, 1.0)  # the true global norm, the same on every rank
        optimizer.step()
        optimizer.zero_grad()
    minitrain.save_checkpoint("ckpt", model, optimizer, step)

`prepare` returns the same model object (its class, names and state_dict keys unchanged) and an
optimizer that behaves like the user's own (its param_groups are the user's groups, so an LR
scheduler works on it). Underneath, the trainable parameters live in flat buffers, sharded by the
ZeRO stage asked for, and the user's optimizer runs on this rank's shard (parallel/shard_optimizer.py).
The CLI trainer goes through the same `parallelize` path with MiniGPT and its own optimizer.

Every call that moves data between ranks is collective: all ranks make it, in the same order.
`save_checkpoint` and `load_checkpoint` first check that every rank arrived, and fail naming the
ranks that did not (within the timeout given to init_distributed) rather than hang.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import re
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint
from ..parallel import FlatStrategy, ModelPlan, cast_parameters, parallelize
from ..parallel.config import ParallelConfig
from ..parallel.pieces import PipelineSplit, Stage, check_pieces, check_split, cross_stage_ties, split_model
from ..parallel.pipeline import Pipeline
from ..parallel.schedules import SCHEDULES
from ..parallel.shard_optimizer import (
    OptimizerFn,
    TorchShardOptimizer,
    check_elementwise,
)
from ..parallel.tp_plan import check_plan, hugging_face_plan
from ..parallel.replica_state import check_buffers_agree, check_feeds, feed_checksum, refuse_batch_statistics
from ..parallel.whole_state import full_model_state, full_optimizer_state, load_optimizer_state
from .scaler import GradScaler
from ..parallel.loss_scale import COMPUTE_DTYPES
from ..runtime.topology import Topology, under_torchrun


@dataclass
class _Session:
    topo: Topology
    timeout_s: float
    gloo: object = None  # a gloo group for arrival checks when the backend is NCCL (monitored_barrier is gloo's)
    layout: Topology | None = None  # the dp x tp layout of the last prepare (None: data parallel over everyone)


_session: _Session | None = None


def init_distributed(backend: str = "auto", timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group torchrun (or `minitrain`'s launcher) describes, or run as a single process
    (rank 0 of 1) when there is none. `backend`: auto (NCCL with a GPU per local rank, else gloo), gloo or
    nccl. `timeout_s`: how long any collective may wait before it fails loudly. Returns (rank, world size);
    calling it again returns the same."""
    global _session
    if _session is None:
        if dist.is_initialized():  # joined already (by a launcher, or the user's own init_process_group)
            topo = Topology.from_initialized()
            gloo = dist.new_group(backend="gloo") if topo.backend != "gloo" else None
        elif under_torchrun():
            topo = Topology.from_env(backend, timeout_s)
            gloo = dist.new_group(backend="gloo") if topo.backend != "gloo" else None
            # A script that never calls cleanup() leaves the groups' threads running into the interpreter's exit,
            # where a torchrun rank may abort ("terminate called without an active exception"): leave them first.
            atexit.register(_leave_at_exit, topo)
        else:
            topo, gloo = Topology.single(), None
        _session = _Session(topo, timeout_s, gloo)
    return _session.topo.rank, _session.topo.world_size


def _leave_at_exit(topo: Topology) -> None:
    if _session is not None and _session.topo is topo:
        cleanup()


def _topology() -> Topology:
    init_distributed()
    return _session.topo


def is_main_process() -> bool:
    """True on rank 0, the rank that should print and write single files."""
    return _topology().is_main


def dp_rank() -> int:
    """This rank's index among the data-parallel replicas of the last `prepare` (its rank without tensor
    parallelism): which slice of the global batch to feed. Every rank of a tensor-parallel group gets the
    same index, and must feed the same batch."""
    _topology()
    return (_session.layout or _session.topo).dp.rank


def dp_world_size() -> int:
    """How many data-parallel replicas the last `prepare` made: world size / tp."""
    _topology()
    return (_session.layout or _session.topo).dp.world_size


def barrier() -> None:
    """Wait until every rank gets here."""
    _topology().everyone.barrier()


def cleanup() -> None:
    """Leave the process group (call once at the end; init_distributed may be called again after it)."""
    global _session
    if _session is not None:
        _session.topo.close()
        _session = None


def wrap_for_ddp(model: nn.Module) -> nn.Module:
    """The model under PyTorch's DistributedDataParallel on minitrain's process group (the model itself in a
    single process), for a loop that keeps its own torch optimizer over model.parameters()."""
    topo = _topology()
    if topo.everyone.group is None:
        return model
    device = topo.device
    return nn.parallel.DistributedDataParallel(model.to(device), device_ids=[device] if device.type == "cuda" else None,
                                               process_group=topo.everyone.group)


# --- prepare ---------------------------------------------------------------------------------------
@dataclass
class _Prepared:
    strategy: FlatStrategy
    settings: dict
    topo: Topology  # the layout the model was prepared in (the world, or dp x tp x pp)
    pipeline: Pipeline | None = None  # pp > 1: the executor, and this rank's stage of the model
    stage: Stage | None = None
    shapes: dict = field(default_factory=dict)  # micro-batch input shape -> the activation shape stages exchange
    max_norm: float | None = None  # set by clip_grad_norm_ for the coming step
    optimizer: PreparedOptimizer | None = field(default=None, repr=False)
    scaler: GradScaler | None = field(default=None, repr=False)  # fp16: the loss scaler the loop calls
    scaler_state: dict | None = None  # fp16: a loaded checkpoint's scaler state, for a scaler made after the load
    groups: list[list[str]] = field(default_factory=list)  # the param groups' parameters, by canonical name
    hooks: list = field(default_factory=list, repr=False)  # handles of the hooks prepare put on the model
    feed: torch.Tensor | None = None  # tp/pp: the checksum of this step's inputs (replica_state.feed_checksum)


_prepared: weakref.WeakKeyDictionary[nn.Module, _Prepared] = weakref.WeakKeyDictionary()


def prepare(model: nn.Module, optimizer_fn: OptimizerFn, *, zero: int = 0, param_groups: list[dict] | None = None,
            precision: str = "fp32", reduce_dtype: str = "fp32", dp: str = "bucketed", bucket_mb: float = 25.0,
            prefetch: bool = True, activation_checkpointing: str | type = "none", tp: int = 1,
            tp_plan: dict | str | None = None, pp: int = 1, pp_split: PipelineSplit | list | str | None = None,
            microbatches: int = 1, schedule: str = "1f1b",
            plan: ModelPlan | None = None) -> tuple[nn.Module, PreparedOptimizer]:
    """Make `model` train data parallel over every rank (ZeRO stage `zero`), with the user's optimizer,
    and with tp > 1 its layers split over groups of tp adjacent ranks (tensor parallel, Megatron-style).

    optimizer_fn: called like a torch optimizer class on param groups, e.g.
        functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1). Under ZeRO (zero >= 1) it runs
        on this rank's shard, which is exact for elementwise optimizers (checked; others are refused).
    param_groups: [{"params": [parameters of model], **options}, ...] as you would give the optimizer
        (e.g. no weight decay for biases and norms); every trainable parameter in exactly one group.
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
        tensor-parallel group). tp_plan: {module-name pattern: style} (parallel/tp_plan.py lists the
        styles), or "auto" for a Hugging Face model's own plan (its config's base_model_tp_plan and the
        head's entry, so `model(...).logits` stays whole).
    pp: pipeline stages (pipeline parallel outermost: dp = world / (tp x pp)); the model is then cut into
        stages by pp_split (a PipelineSplit, the ordered names of its pieces, or "auto" for a Hugging Face
        model's own pipeline plan) and trained by minitrain.pipeline_step(model, inputs, targets, loss_fn)
        instead of forward + backward; each batch is cut into `microbatches` run by `schedule` (1f1b | gpipe).
    Returns (model, optimizer): the same model object, and the optimizer to call step()/zero_grad() on.
    Every rank starts from rank 0's parameters."""
    topo = _topology()
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare needs an nn.Module, got {type(model).__name__}")
    if not isinstance(zero, int) or isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be one of the ZeRO stages 0, 1, 2, 3; got {zero!r}")
    _check_degrees(topo.world_size, tp, tp_plan, pp, pp_split)
    plan = _with_tp_plan(model, plan, tp, tp_plan)
    split = _pipeline_split(model, pp, pp_split, microbatches, schedule)
    if split is not None:
        plan = dataclasses.replace(plan or ModelPlan(),
                                   pipeline_split=lambda m, stage, stages: split_model(m, split, stage, stages))
    if model in _prepared:
        raise ValueError(f"this {type(model).__name__} was already prepared; prepare a model once")
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
    groups = _named_groups(model, param_groups)
    if zero >= 1:
        for _, options in groups:
            check_elementwise(optimizer_fn, options)
    if precision == "fp32":
        reduce = master  # full precision reduces in the parameters' own dtype
    else:
        reduce = torch.float32 if reduce_dtype == "fp32" else COMPUTE_DTYPES[precision]
    pcfg = ParallelConfig(zero=zero, dp=dp, bucket_mb=bucket_mb, prefetch=prefetch, master_dtype=master,
                          reduce_dtype=reduce, master_is_params=True, user_loop=True)
    topo = _on_models_device(topo, model)
    if precision != "fp32":
        cast_parameters(model, COMPUTE_DTYPES[precision])
        _forward_under_autocast(model, topo.device, COMPUTE_DTYPES[precision])

    def make_optimizer(master_vec, flat, shard_ranges):
        return TorchShardOptimizer(master_vec, flat, shard_ranges, zero >= 1, optimizer_fn, groups)

    layout = topo.with_layout(tp, pp)
    compute = COMPUTE_DTYPES[precision] if precision != "fp32" else master
    builder = None if split is None else functools.partial(
        Pipeline, comm=layout.pp, schedule=schedule, microbatches=microbatches, d_model=0, dtype=compute,
        device=topo.device, forward_context=functools.partial(_autocast, topo.device, precision))
    strategy, pipeline = parallelize(model, layout, pcfg, make_optimizer, plan, activation_checkpointing,
                                     None if builder is None else lambda s: builder(s.module, no_sync=s.no_sync))
    settings = {"zero": zero, "precision": precision, "reduce_dtype": reduce_dtype, "dp": dp, "bucket_mb": bucket_mb,
                "prefetch": prefetch, "tp": tp, "pp": pp, "microbatches": microbatches, "schedule": schedule,
                "activation_checkpointing": getattr(activation_checkpointing, "__name__", activation_checkpointing)}
    _session.layout = layout
    stage = None if split is None else Stage(model, split, layout.pp.rank, pp)
    state = _Prepared(strategy, settings, layout, pipeline, stage, groups=[names for names, _ in groups],
                      hooks=refuse_batch_statistics(model, layout.dp.world_size))
    if tp > 1 and split is None:  # a tensor-parallel group must be fed alike: checked at each step
        state.hooks.append(model.register_forward_pre_hook(
            lambda _m, args, kwargs: _note_feed(state, (args, kwargs)), with_kwargs=True))
    state.optimizer = PreparedOptimizer(strategy, state)
    _prepared[model] = state
    return model, state.optimizer


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


def _pipeline_split(model: nn.Module, pp: int, pp_split, microbatches: int, schedule: str) -> PipelineSplit | None:
    """The checked PipelineSplit for pp > 1 (None for pp = 1), before any rank splits anything."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if pp == 1:
        return None
    if pp_split is None:
        raise ValueError(f"pp={pp} needs pp_split: the ordered names of the model's pieces (embedding, the blocks "
                         "container, final norm, head), or 'auto' for a Hugging Face model's own pipeline plan")
    split = (PipelineSplit.auto(model) if pp_split == "auto" else
             pp_split if isinstance(pp_split, PipelineSplit) else PipelineSplit(list(pp_split)))
    ties = cross_stage_ties(model, split, pp)  # checks the split first
    if ties:
        raise ValueError(f"{ties[0]} are one tied weight on different pipeline stages (the embedding on the first, "
                         "the head on the last); untie them (e.g. tie_word_embeddings=False) to pipeline this model")
    check_pieces(model, split, check_split(model, split, pp))  # the pieces must compute what the model's forward does
    return split


def _autocast(device: torch.device, precision: str):
    """The forward context of a pipeline stage: autocast in bf16, nothing in full precision."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=COMPUTE_DTYPES[precision])


def pipeline_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn) -> float:
    """Forward and backward of one batch through a pipelined model (prepare(pp=...)), in place of
    `loss_fn(model(inputs), targets).backward()`: the batch is cut into micro-batches that flow through the
    stages on the schedule; the gradients are synced over data-parallel replicas at the end, ready for
    clip_grad_norm_ and optimizer.step(). loss_fn(output, targets) -> the mean loss of a micro-batch (output is
    what the last piece returns, e.g. logits). Every rank of a pipeline passes the same inputs and targets (the
    first stage reads the inputs, the last the targets). Returns this batch's mean loss on every rank of the
    pipeline. Collective."""
    state = _state_of(model)
    if state.pipeline is None:
        raise ValueError("pipeline_step is for a model prepared with pp > 1; with pp=1 call forward and backward")
    M = state.pipeline.microbatches
    if inputs.size(0) % M:
        raise ValueError(f"a batch of {inputs.size(0)} does not cut into microbatches={M} equal micro-batches")
    _note_feed(state, (inputs, targets))
    shape = _activation_shape(state, inputs[:inputs.size(0) // M])
    loss = state.pipeline.run(inputs, targets, _loss_scale(state), sync=True,
                              forward=lambda inp, tgt: state.stage.forward(inp, tgt, loss_fn), shape=shape)
    pp = state.topo.pp
    value = loss.reshape(1).to(device=state.topo.device, dtype=torch.float64)
    pp.broadcast(value, src=pp.world_size - 1)  # the last stage computed it
    return float(value)  # the one read of the device in a pipeline step


def _note_feed(state: _Prepared, values) -> None:
    state.feed = feed_checksum(state.feed, values)


def _check_feeds(state: _Prepared) -> None:
    """With tensor or pipeline parallelism: every rank of a replica was fed the same inputs since the last step
    (one small all_gather of each rank's checksum, read with the step's)."""
    topo = state.topo
    if state.feed is None or topo.tp.world_size * topo.pp.world_size == 1:
        return
    rows = topo.everyone.gather_rows(state.feed.reshape(1)).view(-1).tolist()
    state.feed = None
    tp, dp = topo.tp.world_size, topo.dp.world_size
    check_feeds(rows, [(rank // tp) % dp for rank in range(topo.world_size)],
                "inputs" if state.pipeline is None else "inputs or targets")


def _activation_shape(state: _Prepared, micro: torch.Tensor) -> tuple[int, ...]:
    """What the stages exchange for micro-batches like `micro`: the first stage's real forward of its pieces
    before the blocks gives it, broadcast over the pipeline (once per input shape)."""
    key = tuple(micro.shape)
    if key not in state.shapes:
        pp, device = state.topo.pp, state.topo.device
        dims = torch.zeros(8, dtype=torch.int64, device=device)
        if pp.rank == 0:
            shape = state.stage.activation_shape(micro.to(device))
            dims[0], dims[1:1 + len(shape)] = len(shape), torch.tensor(shape)
        pp.broadcast(dims, src=0)
        state.shapes[key] = tuple(int(d) for d in dims[1:1 + int(dims[0])])
    return state.shapes[key]


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


def _named_groups(model: nn.Module, param_groups: list[dict] | None) -> list[tuple[list[str], dict]]:
    """[(canonical names of a group's parameters, its options)], checked: every trainable parameter once."""
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
            if id(p) not in trainable:
                raise ValueError(f"param_groups[{g}] holds '{name}', which is frozen (requires_grad=False)")
            if id(p) in seen:
                raise ValueError(f"'{name}' is in param_groups[{seen[id(p)]}] and param_groups[{g}]")
            seen[id(p)] = g
            names.append(name)
        groups.append((names, {k: v for k, v in group.items() if k != "params"}))
    missing = [canonical[i] for i in trainable if i not in seen]
    if missing:
        raise ValueError(f"trainable parameter(s) {', '.join(missing[:5])} are in no param group; add them to one "
                         "or freeze them with requires_grad_(False)")
    return groups


def _forward_under_autocast(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Run the model's forward under autocast (hooks around the call: the model object stays the user's)."""
    contexts: list = []

    def enter(_module, _args):
        contexts.append(torch.autocast(device.type, dtype=dtype))
        contexts[-1].__enter__()

    def leave(_module, _args, _output):
        contexts.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def _state_of(model: nn.Module) -> _Prepared:
    state = _prepared.get(model)
    if state is None:
        raise ValueError(f"this {type(model).__name__} was not returned by minitrain.prepare")
    return state


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, as prepare returns it: step() syncs what backward has not yet synced, clips
    when clip_grad_norm_ asked, updates this rank's shard with the user's optimizer and publishes the new
    parameters; zero_grad() clears the flat gradients. `param_groups` and `state` are the user's optimizer's
    (over this rank's shard), so learning-rate schedulers work on it. Its state is saved and loaded with
    minitrain.save_checkpoint / load_checkpoint (state_dict() of one rank's shard would not reshard)."""

    def __init__(self, strategy: FlatStrategy, prepared: _Prepared):  # noqa: D107 - shares the inner optimizer's
        self._strategy, self._prepared = strategy, prepared
        self.inner: torch.optim.Optimizer = strategy.optimizer.inner
        self.defaults, self.param_groups, self.state = self.inner.defaults, self.inner.param_groups, self.inner.state
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every rank's parameters (collective). A step whose gradients hold NaN/Inf on any rank
        is skipped on every rank (parameters and optimizer state unchanged). In fp16, step through the
        GradScaler instead (scaler.step(optimizer))."""
        if self._prepared.settings["precision"] == "fp16":
            raise RuntimeError("precision='fp16' steps through its loss scaler: scaler = "
                               "minitrain.GradScaler(optimizer), then scaler.scale(loss).backward(); "
                               "scaler.step(optimizer); scaler.update()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(1.0)
        return loss

    def _step(self, loss_scale: float) -> float:
        """The update from gradients of the loss times loss_scale; returns the (unscaled) global gradient norm,
        not finite if the step was skipped."""
        _check_feeds(self._prepared)
        max_norm, self._prepared.max_norm = self._prepared.max_norm, None
        return self._strategy.step(None, loss_scale, max_norm if max_norm is not None else 0.0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients for the next step. They live in minitrain's buffers, so they are zeroed in place;
        with set_to_none (torch's default) ZeRO-2/3 also give back their gradient shard's memory until the next
        backward, as FSDP2 frees its sharded gradients."""
        self._prepared.max_norm = None
        self._strategy.zero_grad(release=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("groups are fixed by prepare(param_groups=...); prepare a new model to change them")

    def state_dict(self) -> dict:
        """The whole optimizer's state_dict in torch's format, as the user's optimizer would give it in one process
        over the whole model (its param groups, with the parameters numbered in their order): every rank's shard,
        slice and stage put together on every rank. Collective: call it on every rank. (save_checkpoint writes
        each rank's part instead, without gathering.)"""
        topo = self._prepared.topo
        return full_optimizer_state(self._strategy, self._prepared.groups, topo.everyone, topo.dp.rank, topo.tp.rank)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state_dict of torch's format (this optimizer's state_dict(), or a plain torch optimizer's over
        the same param groups): each rank keeps the part it holds, and every group's options (lr, betas, ...)."""
        load_optimizer_state(self._strategy, self._prepared.groups, state_dict)

    def __repr__(self) -> str:
        return f"PreparedOptimizer(ZeRO-{self._strategy.stage}, {self.inner!r})"


def no_sync(model: nn.Module):
    """Context for all but the last micro-batch of an accumulated step: backward without the data-parallel
    gradient sync (defined at every ZeRO stage: stages 2 and 3 reduce each micro-batch into their sharded
    gradient, which keeps their memory sharded; 0 and 1 sync once, at the last)."""
    return _state_of(model).strategy.no_sync()


def clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """The global norm of this step's gradients (every rank, every shard; a tied weight counted once), the
    same float on every rank, as torch.nn.utils.clip_grad_norm_ returns it on one process; the coming
    optimizer.step() scales the gradients to at most max_norm. Collective: call it on every rank, after
    backward and before optimizer.step()."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    state = _state_of(model)
    norm = state.strategy.grad_norm(_loss_scale(state))
    state.max_norm = float(max_norm)
    return norm


def _loss_scale(state: _Prepared) -> float:
    """What this step's gradients are multiplied by: fp16's loss scale (until unscale_), else 1."""
    if state.settings["precision"] != "fp16":
        return 1.0
    if state.scaler is None:
        raise RuntimeError("precision='fp16' needs its loss scaler: scaler = minitrain.GradScaler(optimizer), and "
                           "scaler.scale(loss).backward()")
    return state.scaler.loss_scale()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state_dict, with exactly its own keys, shapes and dtypes, on every rank (copies): what to
    evaluate or export in memory. Put together from every data-parallel shard, tensor-parallel slice and pipeline
    stage, so it is collective (call it on every rank) and holds the whole model on each."""
    state = _state_of(model)
    topo = state.topo
    check_buffers_agree(state.strategy.model, topo.dp, "full_state_dict")
    return full_model_state(state.strategy, topo.everyone, topo.dp, topo.tp, topo.pp)


# --- checkpoints ------------------------------------------------------------------------------------
def _all_ranks_arrive(what: str) -> None:
    """Fail, naming the ranks that did not come, unless every rank calls `what` within the timeout."""
    session = _session
    if session is None or session.topo.world_size == 1:
        return
    try:
        dist.monitored_barrier(group=session.gloo, timeout=timedelta(seconds=session.timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        missing = re.search(r"[Rr]anks? ([\d, ]+) failed to pass", str(e))
        who = f"rank(s) {missing.group(1).strip()}" if missing else "rank 0"
        raise checkpoint.CheckpointError(
            f"{what} is collective: rank {session.topo.rank} called it, {who} did not within "
            f"{session.timeout_s:g} s; call it on every rank") from e


def save_checkpoint(directory: str | Path, model: nn.Module, optimizer: PreparedOptimizer, step: int,
                    extra: dict | None = None) -> Path:
    """Save the model and optimizer as a sharded, sha256-verified checkpoint under directory/step-NNNNNN,
    and point directory/latest at it once it is complete. Collective (every rank writes its own shard).
    extra: anything JSON can hold (epoch, data position, ...), returned by load_checkpoint."""
    state = _state_of(model)
    if optimizer is not state.optimizer:
        raise ValueError("save_checkpoint takes the optimizer prepare returned with this model")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative integer (it names the checkpoint, step-NNNNNN), got {step!r}")
    train_state = {"step": step, "optimizer_steps": state.strategy.optimizer.steps_taken,
                   "optimizer_scalars": state.strategy.optimizer.scalar_state(),
                   "optimizer": _optimizer_name(state), "param_groups": state.strategy.optimizer.group_options(),
                   "extra": extra}
    if state.settings["precision"] == "fp16":
        train_state["loss_scaler"] = state.scaler.state_dict() if state.scaler is not None else state.scaler_state
    try:  # refuse what strict JSON cannot hold (a checkpoint's manifest is read back without NaN or Infinity)
        json.dumps(train_state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint: extra must be plain JSON (dicts, lists, strings, finite numbers): {e}") \
            from None
    _all_ranks_arrive("save_checkpoint")
    check_buffers_agree(state.strategy.model, state.topo.dp, "save_checkpoint")
    return checkpoint.save(directory, int(step), state.topo, state.strategy, train_state, {"prepare": state.settings})


def _optimizer_name(state: _Prepared) -> str:
    """The user's optimizer's class, as `module.Class` (what a checkpoint records of it)."""
    cls = type(state.strategy.optimizer.inner)
    return f"{cls.__module__}.{cls.__qualname__}"


def load_checkpoint(directory: str | Path, model: nn.Module, optimizer: PreparedOptimizer) -> tuple[int, dict | None]:
    """Restore a checkpoint saved by save_checkpoint (the directory, or one step-NNNNNN in it) at any world
    size or ZeRO stage; each rank reads only the parts it holds. Returns (step, extra). Collective."""
    state = _state_of(model)
    if optimizer is not state.optimizer:
        raise ValueError("load_checkpoint takes the optimizer prepare returned with this model")
    _all_ranks_arrive("load_checkpoint")
    saved_optimizer = checkpoint.read_manifest(checkpoint.resolve(directory))["train_state"].get("optimizer")
    if saved_optimizer is not None and saved_optimizer != _optimizer_name(state):
        raise checkpoint.CheckpointError(f"checkpoint {directory} holds the state of a {saved_optimizer}, and this "
                                         f"optimizer is a {_optimizer_name(state)}: its state would be dropped or "
                                         "missing; load it with the optimizer it was saved with")
    train_state = checkpoint.load(directory, state.topo, state.strategy)
    if train_state.get("loss_scaler") is not None and state.settings["precision"] == "fp16":
        if state.scaler is not None:
            state.scaler.load_state_dict(train_state["loss_scaler"])
        else:
            state.scaler_state = train_state["loss_scaler"]
    if "param_groups" in train_state:  # the learning rate a scheduler had set, betas, weight decay, ...
        try:
            state.strategy.optimizer.load_group_options(train_state["param_groups"])
        except ValueError as e:
            raise checkpoint.CheckpointError(f"checkpoint {directory}: {e}") from None
    return train_state["step"], train_state.get("extra")


__all__ = [
    "GradScaler",
    "PipelineSplit",
    "PreparedOptimizer",
    "barrier",
    "cleanup",
    "clip_grad_norm_",
    "dp_rank",
    "dp_world_size",
    "full_state_dict",
    "init_distributed",
    "is_main_process",
    "load_checkpoint",
    "no_sync",
    "pipeline_step",
    "prepare",
    "save_checkpoint",
    "wrap_for_ddp",
]
