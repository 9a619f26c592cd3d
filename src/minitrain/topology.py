"""Topology: who this rank is, how many there are, and the groups it talks in.

Built once per process and passed explicitly (no module globals). Today every
rank is a data-parallel replica, so the data-parallel group is the world;
tensor and pipeline degrees will split the world here, in one validated place.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import Comm

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def resolve_backend(backend: str) -> str:
    """'auto' means nccl when there is a CUDA device for every local rank, else gloo."""
    if backend != "auto":
        return backend
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks:
        return "nccl"
    return "gloo"


def under_torchrun() -> bool:
    """True when launched by torchrun (or anything that sets its environment)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def _rendezvous_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The key-value store ranks meet in, as `env://` would make it, but with a key prefix per
    torchrun restart. torchrun's default (static) rendezvous keeps one store across restarts, and
    `env://` adds no prefix, so a restarted rank could read the previous attempt's addresses and
    fail connecting to a dead port: about half of all restarts here, whether or not
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE was set (benchmarks/torchrun_restarts.py)."""
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_hosts_it and rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"minitrain/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    dp: Comm  # data-parallel group (the whole world for now)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls) -> "Topology":
        """One process, no process group: the single-device reference."""
        return cls(0, 1, 0, "none", torch.device("cpu"), Comm())

    @classmethod
    def from_env(cls, backend: str = "auto", timeout_s: float = 300.0) -> "Topology":
        """Join the process group described by torchrun's environment variables."""
        missing = [v for v in TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(f"cannot join a process group: {', '.join(missing)} not set "
                               "(run under torchrun, or use --nproc N to spawn ranks locally)")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        backend = resolve_backend(backend)
        if backend == "nccl":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=_rendezvous_store(rank, world, timeout), rank=rank,
                                world_size=world, timeout=timeout)
        return cls(rank, world, local_rank, backend, device, Comm(rank, world, dist.group.WORLD, device))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
