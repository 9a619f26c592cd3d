"""Parallel strategies, composed in one place: `parallelize`."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..runtime.comm import Comm
from .recompute import apply_activation_checkpointing
from .compiled import compile_blocks
from ..runtime.topology import Topology
from .core.config import ParallelConfig
from .context_parallel.apply import apply_context_parallel
from .context_parallel.hugging_face import apply_to_hugging_face
from .expert_parallel.experts import balance_over_the_batch, shard_experts
from .data_parallel.data_parallel import BucketedDataParallel, NaiveDataParallel, TorchDataParallel
from .core.strategy import FlatStrategy, OptimizerFactory
from .core.flat_parameters import WholeModel
from .core.model_plan import ModelPlan
from .param_server import ParameterServerWorker
from .pipeline_parallel.executor import Pipeline
from .user_loop.replica_state import start_alike
from .state.slices import tensor_parallel_slices
from .tensor_parallel.plans import apply_tensor_parallel
from .user_loop.support import UserLoopSupport
from .zero.sharded_units import ShardedUnits
from .zero.zero1 import Zero1
from .zero.zero2 import Zero2


def parallelize(model: nn.Module, topo: Topology, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                plan: ModelPlan | None = None, activation_checkpointing: str = "none",
                pipeline: Callable[[FlatStrategy, list | None], Pipeline] | None = None,
                compile: bool = False, ep_plan: dict | str | None = None,
                cp_style: str = "ring", cp_plan: str | None = None,
                virtual_stages: int = 1) -> tuple[FlatStrategy, Pipeline | None]:
    """Apply every parallelism the layout asks for to a full model, identical on every rank (or at least
    on rank 0, whose parameters every replica receives), in the only order that works:
    0. every rank is given rank 0's parameters and buffers (the replicas and every part cut from the model start
       as one model), and the whole model's coordinates are taken, so checkpoints of any part share them;
    1. tensor parallel (the plan's): it replaces layers by their slices and expects the whole model
       (the embedding and the head it splits over the vocabulary); everything after must see the slices;
    2. pipeline parallel (the plan's split): it deletes the (already sliced) modules other stages run,
       so that nothing after it, above all the data-parallel strategy, holds or syncs their parameters;
    2b. expert parallelism (topo.ep): each rank keeps its share of every mixture-of-experts layer's experts,
       marked as slices of the whole tensors (expert_parallel/experts.py), and every such layer learns which
       ranks split the batch, for a balancing loss over all of their tokens;
    2c. context parallelism (topo.cp): the plan's attention cores (or with cp_plan="auto" a Hugging Face model's
       attention function) replaced by ring or Ulysses attention over the group, its position modules given the
       whole sequence's positions (context_parallel/); before recomputation, which then replays the new attention;
    3. compiling each block's forward (compile=True; compiled.py), then activation checkpointing: it
       wraps module calls from outside and must wrap the final modules, compiled, while keeping their
       hooks, which ZeRO-3 installs next;
    4. data parallel / ZeRO over the data-parallel group (the replicas of this very slice): it
       flattens (and at ZeRO-3 shards) the parameters, so it comes last; it is told about the
       tensor- and pipeline-parallel groups so that norms cover the whole model.
    `pipeline(strategy, chunks)` builds the executor when the model is pipelined or the batch cut into
    micro-batches (None: no pipeline); chunks: under the interleaved schedule (virtual_stages > 1), each chunk's
    forward, from the plan's pipeline_chunks (which then cuts the model in place of pipeline_split). Returns the strategy (its `module` is what forward runs on)
    and the Pipeline, or None."""
    start_alike(model, topo.everyone)  # 0. every rank holds rank 0's model, before anything is cut from it
    whole = WholeModel.of(model)
    for kind, degree in (("tensor", topo.tp.world_size), ("pipeline", topo.pp.world_size)):
        needed = plan is not None and (plan.tensor_parallel if kind == "tensor" else plan.pipeline_split)
        if degree > 1 and not needed:
            raise ValueError(f"{kind} parallelism (degree {degree}) needs a plan for {type(model).__name__} "
                             f"that says how to split it; without one use data parallel or ZeRO")
    if topo.tp.world_size > 1:
        apply_tensor_parallel(model, plan.tensor_parallel, topo.tp)
        whole.slices = tensor_parallel_slices(model)
    chunks = None
    if topo.pp.world_size > 1 and virtual_stages > 1:  # interleaved: this rank's chunks, and how to run each
        if plan.pipeline_chunks is None:
            raise ValueError(f"the interleaved schedule needs {type(model).__name__}'s plan to say how to cut it into "
                             "chunks (pipeline_chunks); use the 1f1b schedule")
        chunks = plan.pipeline_chunks(model, topo.pp.rank, topo.pp.world_size, virtual_stages)
    elif topo.pp.world_size > 1:
        plan.pipeline_split(model, topo.pp.rank, topo.pp.world_size)
    if topo.ep.world_size > 1:  # each rank keeps its share of every expert layer's experts, as slices
        shard_experts(model, topo.ep, ep_plan)
        whole.slices = tensor_parallel_slices(model)
    balance_over_the_batch(model, topo.data)
    context = [] if topo.cp.world_size == 1 else apply_to_hugging_face(model, topo.cp, cp_style) \
        if cp_plan == "auto" else apply_context_parallel(model, topo.cp, plan, cp_style)
    if compile:
        compile_blocks(model, plan)
    apply_activation_checkpointing(model, activation_checkpointing, plan)
    if topo.servers is not None:  # a parameter-server worker: its servers hold the optimizer (param_server/)
        loop = UserLoopSupport() if pcfg.user_loop else None
        return ParameterServerWorker(model, topo.dp, topo.servers, pcfg, whole=whole, loop=loop), None
    strategy = make_strategy(model, topo.dp, pcfg, make_optimizer, whole, topo.slices, topo.pp)
    strategy.hooks += context
    if topo.ep.world_size > 1:
        strategy.use_experts(topo.ep)
    executor = pipeline(strategy, chunks) if pipeline is not None else None
    if executor is not None and executor.split is not None:  # zero-bubble's notes of the layers' outputs
        strategy.hooks += executor.split.handles
    return strategy, executor


def make_strategy(model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                  whole: WholeModel | None = None, tp: Comm | None = None, pp: Comm | None = None) -> FlatStrategy:
    """The data-parallel strategy over `comm` for `model` (which may already be split across `tp` and `pp`)."""
    kwargs = {"whole": whole, "loop": UserLoopSupport() if pcfg.user_loop else None}
    if pcfg.zero == 3:
        strategy = ShardedUnits(model, comm, pcfg, make_optimizer, reshard_after_forward=True, **kwargs)
    elif pcfg.zero == 2 and ShardedUnits.frees_after_backward(model, pcfg):  # zero/sharded_units.py
        strategy = ShardedUnits(model, comm, pcfg, make_optimizer, reshard_after_forward=False, **kwargs)
    elif pcfg.zero in (1, 2):
        strategy = (Zero1 if pcfg.zero == 1 else Zero2)(model, comm, pcfg, make_optimizer, **kwargs)
    else:
        cls = {"naive": NaiveDataParallel, "bucketed": BucketedDataParallel, "torch": TorchDataParallel}[pcfg.dp]
        strategy = cls(model, comm, pcfg, make_optimizer, **kwargs)
    if tp is not None or pp is not None:
        strategy.use_model_parallel(tp or Comm(device=comm.device), pp or Comm(device=comm.device))
    return strategy


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters (trainable and frozen) to `dtype`; buffers keep theirs (a rotary inv_freq stays float32)."""
    for p in model.parameters():
        if p.dtype != dtype and p.is_floating_point():
            p.data = p.data.to(dtype)


__all__ = ["BucketedDataParallel", "NaiveDataParallel", "TorchDataParallel", "FlatStrategy", "ModelPlan",
           "ParallelConfig", "Pipeline", "WholeModel", "ShardedUnits", "Zero1", "Zero2", "cast_parameters", "make_strategy",
           "parallelize"]
