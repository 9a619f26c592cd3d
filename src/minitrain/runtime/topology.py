"""Topology: who this rank is, how many there are, and the groups it talks in.

Built once per process and passed explicitly (no module globals). The world of
dp x tp x pp ranks is laid out with tensor parallel innermost, then data
parallel, then pipeline outermost:

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

Tensor parallelism all-reduces activations twice per layer in forward and again
in backward, the most frequent and latency-bound traffic, so its ranks are
adjacent (the GPUs of one node, on NVLink). Data parallelism moves the gradients
once per step and overlaps with backward, so it tolerates a slower link.
Pipeline stages exchange only one activation per micro-batch point to point, the
least traffic, so they span the farthest ranks (across nodes). Megatron-LM and
torchtitan order their meshes the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
# Imported before any process group is joined, never after: torch.distributed.nn.functional binds `group.WORLD` as
# a default argument when first imported (torch._dynamo imports it, and any torch optimizer imports torch._dynamo),
# which would keep the group, and its gloo threads, alive past destroy_process_group (Topology.close).
import torch.distributed.nn  # noqa: F401

from .watch import MARGIN_S, CollectiveWatch
from .servers import ServerGroup
from .comm import Comm, concrete_device
from ..errors import ConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def resolve_backend(backend: str) -> str:
    """'auto' means nccl on a machine with a CUDA device, else gloo (local_device then insists on one GPU per
    local rank, rather than a silent fall back to gloo on a node with too few)."""
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_device(backend: str, local_rank: int, local_ranks: int) -> torch.device:
    """This rank's device: under NCCL its local rank's GPU (ConfigError when the node has fewer GPUs than local
    ranks: two ranks on one GPU would deadlock NCCL or run out of memory), the CPU under gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < local_ranks or local_rank >= count:
        raise ConfigError(f"{local_ranks} rank(s) on this node but {count} GPU(s): NCCL needs a GPU per local rank; "
                          "start fewer ranks per node (--nproc-per-node), or use --dist.backend gloo")
    return torch.device("cuda", local_rank)


def under_torchrun() -> bool:
    """True when launched by torchrun (or anything that sets its environment)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def _rendezvous_store(rank: int, world: int, timeout: timedelta, env=os.environ) -> dist.Store:
    """The key-value store ranks meet in, as `env://` would make it, but with a key prefix per
    torchrun restart where the store outlives one. torchrun's default (static) rendezvous keeps one store
    across restarts, its agent's, and `env://` adds no prefix, so a restarted rank could read the previous
    attempt's addresses and fail connecting to a dead port (how often: docs/fault-tolerance.md,
    benchmarks/torchrun_restarts.py). Where rank 0 serves the store (c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    it is a new one every attempt, with no earlier keys to mistake, and no prefix is taken from the restart count:
    each agent counts its own, and a node's agent started again (a node lost and back) counts from 0 while the
    others do not."""
    agent_hosts_it = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                          is_master=not agent_hosts_it and rank == 0, timeout=timeout, multi_tenant=True)
    if not agent_hosts_it:
        return dist.PrefixStore("minitrain", store)
    # An elastic membership change (a node joining) restarts the workers without counting a restart, and the
    # store outlives that too: the new world size tells those attempts apart (a join always grows the world).
    attempt = f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}-world-{world}"
    return dist.PrefixStore(f"minitrain/attempt-{attempt}", store)


def layout_groups(world: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """The global ranks of every tensor-, data- and pipeline-parallel group (see the module docstring)."""
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ConfigError(f"world size {world} is not divisible by tp {tp} x pp {pp}; pick degrees whose product "
                          "divides the number of ranks")
    dp = world // (tp * pp)

    def rank(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    return {"tp": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "dp": [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
            "pp": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)]}


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    dp: Comm  # data-parallel group: replicas of the same model shard, each fed its own data
    tp: Comm = field(default_factory=Comm)  # tensor-parallel group: one layer split across ranks, same data
    pp: Comm = field(default_factory=Comm)  # pipeline group: one rank per stage
    # Expert-parallel group (with_experts): adjacent ranks that each hold and compute 1/ep of every mixture-of-
    # experts layer's experts, and feed their own data; dp is then the experts' replicas (stride ep).
    ep: Comm = field(default_factory=Comm)
    # Context-parallel group (with_context): adjacent ranks that split every sequence of their batch and hold the
    # same parameters; dp is then every rank (the gradients' replicas), and `readers` the ranks that read
    # different sequences (stride cp).
    cp: Comm = field(default_factory=Comm)
    readers: Comm | None = None
    world: Comm | None = None  # every rank, once the world is split (until then dp is the world)
    watch: CollectiveWatch | None = None  # diagnoses hangs and compares fingerprints (None in a single process)
    # A parameter-server world (servers.py), on a worker: where its gradients go and its parameters come from.
    servers: ServerGroup | None = None
    # What each step's statistics are exchanged over, if not everyone (a parameter-server worker's own, under
    # bounded staleness: the workers do not meet at every step).
    step_group: Comm | None = None
    # Every Comm with a process group made by this topology or one derived from it (with_layout), so that
    # close() lets go of each group: see close().
    opened: list[Comm] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data(self) -> Comm:
        """The ranks that each read their own share of a batch: the data-parallel group, or under expert
        parallelism every rank (an expert-parallel group's ranks see different tokens), under context parallelism
        the ranks of different context groups (a group's ranks split the same sequences)."""
        if self.readers is not None:
            return self.readers
        return self.everyone if self.ep.world_size > 1 else self.dp

    def layout(self) -> dict[str, int]:
        """The degrees, as a run's files and checkpoints record them: dp x tp x pp (x ep, x cp where used) is the
        world; dp counts the replicas that read different data."""
        dp = self.readers.world_size if self.readers is not None else self.dp.world_size
        extra = {k: c.world_size for k, c in (("ep", self.ep), ("cp", self.cp)) if c.world_size > 1}
        return {"dp": dp, "tp": self.tp.world_size, "pp": self.pp.world_size, **extra}

    @property
    def slices(self) -> Comm:
        """The group across which a rank's parameters are slices of whole ones: tensor-parallel, or under expert
        parallelism the expert-parallel group (each rank its experts). Norms sum the slices' squares over it;
        gathering the whole model counts everything else once."""
        return self.ep if self.ep.world_size > 1 else self.tp

    @property
    def everyone(self) -> Comm:
        """All ranks as one group: what the ranks must agree on together (per-step statistics,
        stop signals) goes through it."""
        return self.world or self.dp

    def issuing_alone(self) -> "Topology":
        """This one-rank world, its collectives handed to the backend all the same (Comm's issue_alone) rather
        than skipped: NCCL's path (its streams, device-event timings, overlap) run and measured on one GPU."""
        if self.world_size != 1 or self.backend == "none":
            raise ValueError("issuing_alone needs a one-rank world with a process group")
        comm = Comm(0, 1, dist.group.WORLD, self.device, "world", issue_alone=True)
        self.opened.append(comm)
        return Topology(self.rank, 1, self.local_rank, self.backend, self.device, comm, watch=self.watch,
                        opened=self.opened)

    def with_layout(self, tp: int, pp: int) -> "Topology":
        """Split the world into tp x dp x pp groups (collective: every rank creates every group,
        in the same order). With tp = pp = 1 the data-parallel group stays the world."""
        if tp == pp == 1:
            return self
        groups = layout_groups(self.world_size, tp, pp)
        comms = {}
        for kind in ("tp", "dp", "pp"):
            mine = next(g for g in groups[kind] if self.rank in g)
            # A real group even of one rank: PyTorch's DDP (--dp torch) needs one to hand to.
            group, _ = dist.new_subgroups_by_enumeration(groups[kind])
            comms[kind] = Comm(mine.index(self.rank), len(mine), group, self.device, kind, self.watch)
        self.opened.extend(comms.values())
        return Topology(self.rank, self.world_size, self.local_rank, self.backend, self.device, **comms,
                        world=self.everyone, watch=self.watch, opened=self.opened)

    def with_experts(self, ep: int) -> "Topology":
        """Split the world into expert-parallel groups of ep adjacent ranks and the groups of their replicas
        (stride ep), which become the data-parallel group: a mixture of experts' weights differ within an ep
        group and are averaged over their replicas (collective; tensor and pipeline parallelism are not combined
        with it). ep = 1: this topology."""
        if ep == 1:
            return self
        if self.tp.world_size > 1 or self.pp.world_size > 1:
            raise ConfigError("expert parallelism is not combined with tensor or pipeline parallelism")
        comms = self._adjacent_and_strided(ep, "ep", "dp")
        return Topology(self.rank, self.world_size, self.local_rank, self.backend, self.device, dp=comms["dp"],
                        ep=comms["ep"], world=self.everyone, watch=self.watch, opened=self.opened)

    def with_context(self, cp: int) -> "Topology":
        """Split the world into context-parallel groups of cp adjacent ranks, each splitting the same sequences,
        and the groups of their stride-cp replicas, which read different ones (`data`); every rank holds the same
        parameters, so the data-parallel group, over which gradients are averaged and ZeRO shards, is the world
        (collective; tensor, pipeline and expert parallelism are not combined with it). cp = 1: this topology."""
        if cp == 1:
            return self
        if self.tp.world_size > 1 or self.pp.world_size > 1 or self.ep.world_size > 1:
            raise ConfigError("context parallelism is not combined with tensor, pipeline or expert parallelism")
        comms = self._adjacent_and_strided(cp, "cp", "readers")
        return Topology(self.rank, self.world_size, self.local_rank, self.backend, self.device, dp=self.dp,
                        cp=comms["cp"], readers=comms["readers"], world=self.everyone, watch=self.watch,
                        opened=self.opened)

    def _adjacent_and_strided(self, size: int, adjacent: str, strided: str) -> dict[str, Comm]:
        """This rank's group of `size` adjacent ranks (named `adjacent`) and its group of their stride-`size`
        replicas (`strided`). Collective: every rank creates every group, in the same order."""
        groups = layout_groups(self.world_size, size, 1)  # adjacent groups of `size` ranks are the layout's "tp"
        comms = {}
        for kind, name in (("tp", adjacent), ("dp", strided)):
            mine = next(g for g in groups[kind] if self.rank in g)
            group, _ = dist.new_subgroups_by_enumeration(groups[kind])
            comms[name] = Comm(mine.index(self.rank), len(mine), group, self.device, name, self.watch)
        self.opened.extend(comms.values())
        return comms

    def as_worker(self, group: ServerGroup) -> "Topology":
        """A worker's view of a parameter-server world: its data-parallel group, and everyone, are the workers.
        Under bounded staleness (K > 0) the workers do not meet at every step, so what they would agree on at each
        step (its statistics, a stop signal) is each worker's own: the step group is this rank alone."""
        alone = Comm(device=self.device) if group.staleness else None
        return Topology(group.own.rank, group.own.world_size, self.local_rank, self.backend, self.device, group.own,
                        watch=self.watch, opened=self.opened, servers=group, step_group=alone)

    @property
    def step_peers(self) -> Comm:
        """The ranks that exchange each step's statistics (and so agree on a stop signal at a step)."""
        return self.step_group or self.everyone

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "Topology":
        """One process, no process group: the single-device reference."""
        device = concrete_device(device)
        return cls(0, 1, 0, "none", device, Comm(device=device))

    @classmethod
    def from_env(cls, backend: str = "auto", timeout_s: float = 300.0, report=None) -> "Topology":
        """Join the process group described by torchrun's environment variables. A collective stuck for
        `timeout_s` ends every rank with a diagnosis (runtime/watch.py), handed to `report(text, culprit)`
        (default: stderr); the process group's own timeout is MARGIN_S later, so the diagnosis comes first."""
        missing = [v for v in TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(f"cannot join a process group: {', '.join(missing)} not set "
                               "(run under torchrun, or use --nproc N to spawn ranks locally)")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        backend = resolve_backend(backend)
        device = local_device(backend, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if device.type == "cuda":  # before any CUDA work: every rank's kernels and NCCL on its own GPU
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s + MARGIN_S)
        store = _rendezvous_store(rank, world, timeout)
        # device_id binds the group to this GPU (NCCL connects eagerly, and never guesses GPU 0 for a rank).
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        watch = CollectiveWatch(rank, world, store, timeout_s, report)
        comm = Comm(rank, world, dist.group.WORLD, device, "world", watch)
        return cls(rank, world, local_rank, backend, device, comm, watch=watch, opened=[comm])

    @classmethod
    def from_initialized(cls, report=None) -> "Topology":
        """The process group this process has already joined (the user's own init_process_group), as a Topology
        with a new watch that speaks MARGIN_S before the group's own timeout (or at half of a timeout shorter than
        2 x MARGIN_S). Code running under minitrain's launcher is handed the launcher's Topology instead."""
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())  # "gloo", "nccl", or a per-device list such as "cpu:gloo,cuda:nccl"
        backend = "nccl" if "nccl" in backend else "gloo"
        device = torch.device("cpu")
        if backend == "nccl":
            # The local rank's GPU; a launcher that sets no LOCAL_RANK leaves the device the process chose (its
            # group's bound device, or torch.cuda.set_device's), not GPU 0 for every rank.
            local = os.environ.get("LOCAL_RANK")
            bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
            index = int(local) if local is not None else bound.index if bound is not None \
                else torch.cuda.current_device()
            device = local_device(backend, index, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            torch.cuda.set_device(device)
        local_rank = device.index if device.type == "cuda" else int(os.environ.get("LOCAL_RANK", "0"))
        watch = cls._new_watch(rank, world, device, report)
        comm = Comm(rank, world, dist.group.WORLD, device, "world", watch)
        return cls(rank, world, local_rank, backend, device, comm, watch=watch, opened=[comm])

    @staticmethod
    def _new_watch(rank: int, world: int, device: torch.device, report) -> CollectiveWatch:
        try:
            pg_timeout = dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):  # a backend that does not say: torch's default, 30 minutes
            pg_timeout = 1800.0
        watch_s = pg_timeout - MARGIN_S if pg_timeout > 2 * MARGIN_S else pg_timeout / 2
        return CollectiveWatch(rank, world, dist.distributed_c10d._get_default_store(), watch_s, report)

    def close(self) -> None:
        """Tear down in order: the watch's thread, then every process group. A group's threads (gloo's loop
        and workers) end when the last reference to it goes. Objects that outlive the run can still reach
        the Comms (a strategy's gradient hooks live in autograd, where Python's collector cannot free them),
        so each Comm lets go of its group here: otherwise the threads would live on into the interpreter's exit,
        and a torchrun rank that had finished its run could abort there ("terminate called without an active
        exception"; docs/multi-node.md, clean exits; benchmarks/multinode.py repeats it)."""
        if self.watch is not None:  # its thread stops before the process group (and its store) goes
            self.watch.close()
        for comm in self.opened:
            comm.release()
        if dist.is_initialized():
            dist.destroy_process_group()
