"""Who is a parameter server and who a worker (parallel/param_server/ says what they do).

Of a world of N ranks, the last S are servers and the first W = N - S are workers, so that rank 0, which speaks
and writes the run's files, is a worker. Server s holds the s-th of S contiguous shards of the flat parameter
vector. Workers and servers talk point to point over the world's group; the workers also form a group of their
own (their data shards, their statistics at K = 0) and the servers one (the global gradient norm).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..errors import ConfigError
from .comm import Comm


def shard_bounds(numel: int, servers: int, block: int = 1) -> list[tuple[int, int]]:
    """S contiguous ranges covering [0, numel), cut at multiples of `block` (the first ones a block longer where
    the blocks do not divide evenly). ConfigError when a server would get nothing."""
    blocks = -(-numel // block)
    if blocks < servers:
        raise ConfigError(f"{servers} parameter servers for {numel:,} parameters: the shards are cut at multiples of "
                          f"{block:,} elements (so that the gradient norm sums as data parallel sums it), which makes "
                          f"{blocks} shard(s); use at most {blocks} server(s)")
    base, extra = divmod(blocks, servers)
    bounds, start = [], 0
    for s in range(servers):
        stop = min(numel, start + (base + (s < extra)) * block)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass
class ServerGroup:
    """This rank's place in a parameter-server world."""

    world: Comm  # every rank: the pushes and pulls go over it (ranks are the world's)
    workers: list[int]  # the workers' world ranks, in order (worker index = position)
    servers: list[int]  # the servers' world ranks, in order (server index = position: its shard)
    staleness: int  # K: a worker computes step c on parameters at least version c - 1 - K
    own: Comm  # this rank's side: the workers' group on a worker, the servers' on a server
    # --ps.elastic: a worker but worker 0 that dies is left out and the others go on (the launcher says which left).
    elastic: bool = False

    @property
    def is_server(self) -> bool:
        return self.world.rank in self.servers

    @property
    def index(self) -> int:
        """This rank's position among its own kind."""
        return (self.servers if self.is_server else self.workers).index(self.world.rank)

    @classmethod
    def split(cls, world: Comm, servers: int, staleness: int, watch=None, elastic: bool = False) -> ServerGroup:
        """Collective (every rank creates both groups, in the same order)."""
        n = world.world_size
        if not 0 < servers < n:
            raise ConfigError(f"--ps.servers {servers} leaves no worker in a world of {n} ranks; give fewer servers "
                              "or more ranks (--nproc)")
        if staleness < 0:
            raise ConfigError(f"--ps.staleness must be >= 0, got {staleness}")
        kinds = [list(range(n - servers)), list(range(n - servers, n))]
        group, _ = dist.new_subgroups_by_enumeration(kinds)
        mine = next(k for k in kinds if world.rank in k)
        own = Comm(mine.index(world.rank), len(mine), group, world.device, "ps-servers" if mine is kinds[1]
                   else "ps-workers", watch)
        return cls(world, kinds[0], kinds[1], staleness, own, elastic)
