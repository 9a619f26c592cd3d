"""Parameter servers through the API: prepare(model, optimizer_fn, servers=S, staleness=K) makes the last S ranks
servers that hold the parameters and the user's optimizer, shard by shard, and the others workers that train as
usual (parallel/param_server/: worker.py and server.py, the two sides; the CLI's --ps.servers is the same code).

    model, optimizer = minitrain.prepare(model, optimizer_fn, servers=1)
    if minitrain.is_server():
        minitrain.serve()                     # answers the workers until every one has called cleanup()
    else:
        for x, y in batches:                  # this worker's share: dp_rank() / dp_world_size() count workers
            loss_fn(model(x), y).backward()
            optimizer.step()                  # push the gradient, pull the updated parameters
            optimizer.zero_grad()
    minitrain.cleanup()

On a worker, optimizer.step() pushes its gradient to every server and pulls the parameters back; the servers
sum the workers' gradients in worker order, divide by their number and step the user's optimizer on their
shards, so at K = 0 the run is data parallel's, bit for bit. clip_grad_norm_ pushes there instead (the global
norm is the servers' to compute): it returns the norm of that update and step() has nothing left to do. Each
push carries every param group's learning rate, so a scheduler on the worker's optimizer drives the servers'.
"""
from __future__ import annotations

from torch import nn

from ..parallel.core.config import ParallelConfig
from ..parallel.core.flat_parameters import FlatParameters, WholeModel
from ..parallel.param_server import ParameterServer
from ..runtime.servers import ServerGroup
from ..runtime.topology import Topology
from .session import current

# What prepare(servers=...) does not combine with yet, by its argument's value when not the default.
CLASHES = {"zero": 0, "tp": 1, "pp": 1, "ep": 1, "offload": "none", "dp": "bucketed"}


def check_server_settings(servers, staleness, world_size: int, backend: str, precision: str, given: dict) -> None:
    """ValueError unless parameter servers can run with these prepare arguments."""
    for name, value in (("servers", servers), ("staleness", staleness)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not servers:
        if staleness:
            raise ValueError("staleness needs parameter servers (servers=S)")
        return
    if servers >= world_size:
        raise ValueError(f"servers={servers} leaves no worker in a world of {world_size} rank(s)")
    if backend != "gloo":
        raise ValueError(f"parameter servers run over gloo (a server receives from whichever worker sends first, "
                         f"which {backend} cannot); init_distributed(backend='gloo')")
    clashes = [f"{name}={given[name]!r}" for name, default in CLASHES.items() if given[name] != default]
    if precision == "fp16":
        clashes.append("precision='fp16'")
    if clashes:
        raise ValueError(f"servers={servers} trains each worker's whole model with the optimizer on the servers; "
                         f"it does not combine with {', '.join(clashes)}")


def split_world(topo: Topology, servers: int, staleness: int) -> tuple[ServerGroup, Topology | None]:
    """Collective: who serves and who works; a worker's topology (its data-parallel group is the workers'), None
    on a server."""
    group = ServerGroup.split(topo.dp, servers, staleness, topo.watch)
    topo.opened.append(group.own)
    return group, (None if group.is_server else topo.as_worker(group))


def make_server(model: nn.Module, group: ServerGroup, pcfg: ParallelConfig, make_optimizer) -> ParameterServer:
    """This rank's server: its shard of the model's flat parameters (worker 0 sends the starting values) and the
    user's optimizer over it (every push carries its param groups' learning rates)."""
    flat = FlatParameters(model, 1, None, False, WholeModel.of(model))
    return ParameterServer(flat, group, pcfg, make_optimizer, None, pcfg.reduce_dtype)


class ServerRankOptimizer:
    """What prepare returns as the optimizer on a server rank: there is nothing to train there."""

    def _refuse(self, *_args, **_kwargs):
        raise RuntimeError("this rank is a parameter server (minitrain.is_server()): call minitrain.serve() on it "
                           "instead of training")

    step = zero_grad = state_dict = load_state_dict = _refuse


def is_server() -> bool:
    """True on a parameter-server rank of prepare(..., servers=S)."""
    return current().serving


def serve() -> dict:
    """On a server rank: answer the workers until every one of them has called cleanup() (or stopped); returns
    this server's figures (its shard, the updates applied, the staleness of the gradients in them)."""
    session = current()
    if session.server is None:
        raise RuntimeError("serve() ran already on this rank" if session.serving else
                           "serve() runs on a parameter-server rank (prepare(..., servers=S), minitrain.is_server())")
    server, session.server = session.server, None
    return server.serve()
