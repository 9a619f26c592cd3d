"""A parameter-server run (--ps.servers S): the last S ranks serve, the others train as data-parallel workers whose
gradient sync and update are a push to the servers and a pull from them (parallel/param_server/worker.py).

A worker runs the usual loop (loop.py) with its own topology (Topology.as_worker): logging, evaluation, stop
signals and guards as in any run. A server builds the model only for its layout and starting values, then serves
until the last step's update has reached every worker. At the end rank 0 adds the servers' figures (updates, the
staleness of the gradients they applied) to the run's summary.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import RunConfig
from ..errors import ConfigError
from ..models import spec_for
from ..models.size import model_params
from ..parallel.core.flat_parameters import FlatParameters, WholeModel
from ..parallel.core.norms import SquareSums
from ..parallel.param_server import ParameterServer
from ..parallel.param_server.protocol import SUMMARY
from ..parallel.param_server.worker import DepartureWatch
from ..runtime.servers import ServerGroup, shard_bounds
from ..runtime.topology import Topology
from .faults import Faults
from .optim import flat_adamw_factory
from .precision import compute_dtype, reduce_dtype
from .run_files import write_json
from .trainer import parallel_config, seed_everything


def train_with_parameter_servers(topo: Topology, cfg: RunConfig, train: Callable[[Topology, RunConfig], dict]
                                 ) -> dict | None:
    """Collective over the whole world; a worker trains with train(its topology, cfg) (loop.py's run), and rank 0
    (a worker) returns the run's summary."""
    if topo.backend != "gloo":  # --backend auto picks NCCL on a GPU machine; the settings refuse only an explicit one
        raise ConfigError("parameter servers run over gloo (a server receives from whichever worker sends first, "
                          "which NCCL cannot); give --backend gloo")
    group = ServerGroup.split(topo.dp, cfg.ps.servers, cfg.ps.staleness, topo.watch, cfg.ps.elastic)
    topo.opened.append(group.own)
    # Workers and servers never run the same collectives, so the periodic fingerprint comparison (every rank's
    # digest through the store) would wait for servers that never come; hang diagnosis still watches every op.
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, fingerprint_every=0))
    if topo.is_main:
        print(_layout_line(group), flush=True)
    # --ps.elastic: worker 0 tells the servers of each worker the launcher let leave, until they have reported.
    departures = DepartureWatch(group) if group.elastic and not group.is_server and group.index == 0 else None
    try:
        if group.is_server:
            summary = None
            served = _serve(topo, cfg, group)
        else:
            summary = train(topo.as_worker(group), cfg)
            served = None
        servers = _servers_report(group, served)
    finally:
        if departures is not None:
            departures.close()
    if topo.is_main:
        summary = {**summary, "parameter_servers": {"servers": len(group.servers), "workers": len(group.workers),
                                                    "staleness_bound": group.staleness, "served": servers}}
        write_json(Path(cfg.out) / "summary.json", summary)
        print(_staleness_line(servers), flush=True)
        for gone in servers[0]["left"]:
            print(f"worker {gone['worker']} (rank {gone['rank']}) left the run; its gradients went into updates up to "
                  f"{gone['last_update']}, the later ones are the other workers' mean", flush=True)
    return summary


def _servers_report(group: ServerGroup, served: dict | None) -> list[dict]:
    """On worker 0, every server's figures (each sends its own; elsewhere []). Point to point, not gathered: under
    --ps.elastic a worker that left is not there to take part."""
    world = group.world
    if group.is_server:
        data = torch.tensor(list(json.dumps(served).encode()), dtype=torch.uint8)
        world.send(torch.tensor([data.numel()]), group.workers[0], SUMMARY)
        world.send(data, group.workers[0], SUMMARY)
        return []
    if group.index != 0:
        return []
    reports = []
    for server in group.servers:
        size = torch.empty(1, dtype=torch.int64)
        world.recv(size, server, SUMMARY)
        data = torch.empty(int(size), dtype=torch.uint8)
        world.recv(data, server, SUMMARY)
        reports.append(json.loads(bytes(data.tolist()).decode()))
    return reports


def check_servers(cfg: RunConfig) -> None:
    """ConfigError before any rank starts when the model has fewer of the norm's chunks than --ps.servers (the
    shards are cut at them: runtime/servers.py)."""
    shard_bounds(model_params(cfg.model), cfg.ps.servers, SquareSums.block(torch.device("cpu")))


def _layout_line(group: ServerGroup) -> str:
    w, s, k = len(group.workers), len(group.servers), group.staleness
    mode = "synchronous (K = 0)" if not k else f"a worker at most {k} step(s) ahead of the slowest (K = {k})"
    if group.elastic:
        mode += "; a worker but worker 0 that dies is left out and the others go on (--ps.elastic)"
    return (f"parameter servers: ranks {group.servers[0]}-{group.servers[-1]} each hold 1/{s} of the parameters and "
            f"optimizer state; {w} worker(s) push gradients and pull parameters, {mode}")


def _staleness_line(served: list[dict]) -> str:
    """How stale the applied gradients were, over every update (the servers apply the same ones)."""
    counts = served[0]["staleness_counts"]
    spread = ", ".join(f"{n} x {s}" for s, n in counts.items())
    return (f"parameter servers applied {served[0]['updates']} updates ({served[0]['skipped']} skipped); staleness "
            f"of the gradients in them (updates missed): {spread}")


def _serve(topo: Topology, cfg: RunConfig, group: ServerGroup) -> dict:
    """Build the model for its flat layout (the workers send the starting values) and serve every step."""
    seed_everything(cfg.train.seed, topo.rank)
    model = spec_for(cfg.model).build(cfg.model).to(dtype=compute_dtype(cfg.train))
    flat = FlatParameters(model, 1, None, False, WholeModel.of(model))
    pcfg = parallel_config(cfg)
    server = ParameterServer(flat, group, pcfg, flat_adamw_factory(cfg.train), cfg.train.steps,
                             reduce_dtype(cfg.train), Faults(cfg.fault, topo.rank, resumed=False))
    return server.serve()
