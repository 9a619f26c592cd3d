"""One process's place in the distributed run, as the public API sees it: the topology it joined
(init_distributed), the data-parallel layout of the last prepare, and the models prepared in it (with what
prepare made for each). There is one Session at a time; cleanup() ends it: every prepared model's hooks come
off it (the model is plain again, and nothing keeps the strategy alive) and the process group is left.
"""
from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import TYPE_CHECKING
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import FlatStrategy
from ..parallel.core.offload import OffloadStore
from ..parallel.pipeline_parallel.split import Stage
from ..parallel.pipeline_parallel.executor import Pipeline
from ..runtime.arrival import arrive
from ..runtime.comm import Comm
from ..runtime.topology import Topology, under_torchrun

if TYPE_CHECKING:
    from ..parallel.context_parallel.layout import ContextLayout
    from .moe_stats import MoECounters


@dataclass(eq=False)
class Prepared:
    """What prepare made for one model."""

    strategy: FlatStrategy
    settings: dict  # prepare's arguments, as a checkpoint records them
    topo: Topology  # the layout the model was prepared in (the world, or dp x tp x pp)
    pipeline: Pipeline | None = None  # pp > 1: the executor, and this rank's stage of the model
    stage: Stage | None = None
    shapes: dict = field(default_factory=dict)  # micro-batch input shape -> the activation shape stages exchange
    max_norm: float | None = None  # set by clip_grad_norm_ for the coming step
    pushed_norm: float | None = None  # a parameter-server worker's: clip_grad_norm_ took this step's update
    optimizer: object = field(default=None, repr=False)  # the PreparedOptimizer (optimizer.py)
    scaler: object = field(default=None, repr=False)  # fp16: the GradScaler the loop calls (scaler.py)
    scaler_state: dict | None = None  # fp16: a loaded checkpoint's scaler state, for a scaler made after the load
    groups: list[list[str]] = field(default_factory=list)  # the param groups' parameters, by canonical name
    hooks: list = field(default_factory=list, repr=False)  # handles of the hooks prepare put on the model itself
    feed: torch.Tensor | None = None  # tp/pp: the checksum of this step's inputs (replica_state.feed_checksum)
    offload: OffloadStore | None = None  # where the optimizer's master and state live when offloaded
    user_class: type | None = None  # the model's own class, given back by close() (ddp_idioms.py)
    sync_requested: bool = True  # DDP's require_backward_grad_sync, as the user last set it (ddp_idioms.py)
    unsynced: contextlib.ExitStack | None = None  # the strategy's no_sync, entered because of it
    moe: MoECounters | None = None  # a mixture of experts: what moe_stats reads (moe_stats.py)
    context: ContextLayout | None = None  # cp > 1: which tokens of a sequence this rank holds (context_shard)
    context_tokens: int | None = None  # ...and how many of them context_shard last gave (the forward checks it)

    def close(self) -> None:
        """Every hook prepare and the strategy put on the model, removed; offload files removed. A parameter-server
        worker first waits for the update of its last step (under K > 0 a worker ahead waits for the others), so
        every worker ends on the same parameters, then tells the servers it is done."""
        incomplete = False
        if self.settings.get("servers") and not self.strategy.closed and not self.strategy.ending:
            incomplete = not self.strategy.wait_for_last_update()
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        if self.unsynced is not None:
            self.unsynced.close()
            self.unsynced = None
        if self.user_class is not None:
            self.strategy.model.__class__ = self.user_class
        self.strategy.close()
        if self.offload is not None:
            self.offload.close()
        if incomplete:
            raise RuntimeError("the update of this worker's last step never came: another worker called cleanup() "
                               "first (with parameter servers every worker runs the same number of steps)")


def held_apart(state: Prepared) -> str | None:
    """Why this rank does not hold the whole model and optimizer state (a shard, slices, a stage, its experts), in
    words for a message; None where it does (data parallel at ZeRO-0, where one rank may read them alone)."""
    settings = state.settings
    if state.strategy.stage >= 1:
        return f"at ZeRO-{state.strategy.stage} each rank holds a shard of the optimizer's state"
    for degree, what in (("tp", "slices of the model's layers"), ("pp", "one stage of the model"),
                         ("ep", "its share of the experts")):
        if settings.get(degree, 1) > 1:
            return f"with {degree}={settings[degree]} each rank holds {what}"
    return None


class Session:
    def __init__(self, topo: Topology, timeout_s: float):
        self.topo, self.timeout_s = topo, timeout_s
        self.layout: Topology | None = None  # the dp x tp x pp layout of the last prepare (None: dp over everyone)
        # Weak keys: a model the user drops takes its entry with it (once its hooks are off: cleanup, or never
        # prepared twice in one session).
        self.prepared: weakref.WeakKeyDictionary[nn.Module, Prepared] = weakref.WeakKeyDictionary()
        self.server = None  # on a parameter-server rank, its ParameterServer (api/servers.py) until serve() ran
        self.serving = False  # this rank is a server (serve() may have run)

    def state_of(self, model: nn.Module) -> Prepared:
        state = self.prepared.get(model)
        if state is None:
            raise ValueError(f"this {type(model).__name__} was not returned by minitrain.prepare in this session "
                             "(prepare it after init_distributed; cleanup() ends a session)")
        return state

    def arrive(self, ranks: Comm, what: str, why: str) -> None:
        """Every rank of `ranks` calls `what` here, or every rank is told where each one is (runtime/arrival.py): a
        rank busy elsewhere is waited for up to the session's timeout; one that can never come stops every rank at
        once."""
        arrive(ranks, what, why, self.timeout_s)

    def end(self) -> None:
        """Every prepared model closed, even past one that raises (the first error is raised at the end)."""
        errors = []
        for state in list(self.prepared.values()):
            try:
                state.close()
            except Exception as e:  # noqa: BLE001 - the others are still closed, the group still left
                errors.append(e)
        self.prepared.clear()
        self.topo.close()
        if errors:
            raise errors[0]


_current: Session | None = None


DEFAULT_TIMEOUT_S = 300.0  # a process group minitrain makes: how long a collective may wait


def init_distributed(backend: str = "auto", timeout_s: float | None = None,
                     topology: Topology | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes, or run as a single process (rank 0 of 1) when there is none.
    `backend`: auto (NCCL with a GPU per local rank, else gloo), gloo or nccl. `timeout_s`: how long any
    collective may wait for a rank before it fails loudly (a rank that can never come is found in seconds:
    runtime/arrival.py); default 300 s for a group minitrain makes, and for a group joined some other way (the
    user's own init_process_group, used as it is) that group's own timeout, as its collectives would wait.
    `topology`: the Topology minitrain's own launcher made for this rank (launch(fn, n) calls fn(topology, ...)),
    whose collective watch reports to the launcher. Returns (rank, world size); calling it again returns the same."""
    global _current
    if _current is None:
        if topology is not None:
            topo = topology
        elif dist.is_initialized():
            topo = Topology.from_initialized()
        elif under_torchrun():
            topo = Topology.from_env(backend, timeout_s or DEFAULT_TIMEOUT_S)
        else:
            topo = Topology.single()
        if topology is None and topo.world_size > 1:
            # A script that never calls cleanup(), or ends the process group itself (destroy_process_group(), as a
            # DDP script does), leaves minitrain's references to the groups, and so their threads, into the
            # interpreter's exit, where a rank may abort ("terminate called without an active exception"): let
            # go of them first.
            atexit.register(_leave_at_exit, topo)
        if timeout_s is None:
            timeout_s = topo.watch.timeout_s if topo.watch is not None else DEFAULT_TIMEOUT_S
        _current = Session(topo, timeout_s)
    elif topology is not None and topology is not _current.topo:
        raise ValueError("init_distributed was called already with another topology; cleanup() first")
    return _current.topo.rank, _current.topo.world_size


def _leave_at_exit(topo: Topology) -> None:
    if _current is not None and _current.topo is topo:
        cleanup()


def current() -> Session:
    """The session, joined now (as init_distributed() would) if the script has not."""
    init_distributed()
    return _current


def state_of(model: nn.Module) -> Prepared:
    """What prepare made for `model` (ValueError for a model it did not return)."""
    return current().state_of(model)


def is_main_process() -> bool:
    """True on rank 0, the rank that should print and write single files."""
    return current().topo.is_main


def dp_rank() -> int:
    """This rank's index among the data-parallel replicas of the last `prepare` (its rank without tensor
    parallelism): which slice of the global batch to feed. Every rank of a tensor-parallel group gets the
    same index, and must feed the same batch; under expert parallelism every rank has its own."""
    session = current()
    return (session.layout or session.topo).data.rank


def dp_world_size() -> int:
    """How many slices of the global batch the last `prepare` feeds: world size / (tp x pp x cp), or under expert
    parallelism the world size."""
    session = current()
    return (session.layout or session.topo).data.world_size


def barrier() -> None:
    """Wait until every rank gets here (a rank that is elsewhere, in another collective, stops every rank at once,
    naming each rank's line)."""
    session = current()
    session.arrive(session.topo.everyone, "minitrain.barrier()", "every rank must reach it: call it on every rank")
    session.topo.everyone.barrier()


def cleanup() -> None:
    """End the session: every prepared model's hooks come off (so a model and optimizer you drop are freed), and
    the process group is left. Call once at the end; init_distributed may be called again after it."""
    global _current
    if _current is not None:
        session, _current = _current, None
        atexit.unregister(_leave_at_exit)  # (it holds the topology: nothing is left to leave)
        session.end()


def wrap_for_ddp(model: nn.Module) -> nn.Module:
    """The model under PyTorch's DistributedDataParallel on minitrain's process group (the model itself in a
    single process), for a loop that keeps its own torch optimizer over model.parameters()."""
    topo = current().topo
    if topo.everyone.group is None:
        return model
    device = topo.device
    return nn.parallel.DistributedDataParallel(model.to(device), device_ids=[device] if device.type == "cuda" else None,
                                               process_group=topo.everyone.group)
