"""Parameter servers (Li et al., OSDI 2014): synchronous, or with bounded staleness (stale-synchronous parallel,
Ho et al., NIPS 2013). Who is which: runtime/servers.py.

Server s holds the master weights and optimizer state of the s-th contiguous shard of the flat parameter vector
(the layout data parallel uses, layout.py). A worker holds the whole model, computes its gradient on its own data,
pushes each shard of it to that shard's server and pulls the updated shards back:

  worker w, step c:  forward and backward on its parameters, whose shard s is at version v_s
                     -> each server: a header (c, v_s, lr, loss scale, clip) and the gradient's shard
                     <- each server, once its version is >= c - K (after the last step: the last version):
                        a header (version, norm, each worker's staleness in that update) and the shard
  server, update u:  once every worker's gradient of step u is in: their sum in worker order, divided by W (data
                     parallel's all-reduce sum, then its division), the global norm (squares summed over the
                     servers), the clipped optimizer step on the shard. Its version is then u.

K = 0: a worker waits for its own step's update: data parallel by another route, bit for bit at two workers (the
all-reduce's a + b in either order is the same sum). K > 0: a worker may compute step c on parameters as old as
version c - 1 - K, so it runs up to K steps ahead of the slowest worker and blocks there; a server answers with
the newest version it has. The staleness of a gradient is the number of updates between the version it was
computed on and the update it goes into (u - 1 - v), recorded for every update.

How gradients are applied: as they arrive each is held for its step, and the step's update is applied once the
last worker's has come, as one optimizer step on their mean (each gradient scaled by 1/W). The SSP papers apply
every worker's update on arrival, scaled by 1/W, to plain SGD, where the two are the same sum; with a stateful
optimizer (Adam) W updates per step on fractions of the gradient would be another optimizer than the user's, and
K = 0 would no longer be data parallel. A server therefore holds up to K + 1 steps of W gradient shards.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn as nn

from ..runtime.comm import Comm, PendingCollective
from ..runtime.servers import ServerGroup, shard_bounds
from .config import ParallelConfig
from .flat import FlatStrategy
from .layout import FlatParameters
from .norms import SquareSums, clip_coefficient, sum_in_order

# Message tags: a server takes headers from any worker, then that worker's gradient.
INITIAL, HEADER, GRADIENT, REPLY, PARAMS = 1, 2, 3, 4, 5
NO_LR, NO_CLIP = math.nan, -1.0  # a header's "use the optimizer's own lr" and "use the run's grad_clip"


class ServerHeldOptimizer:
    """A worker's stand-in for the optimizer its servers hold: nothing here, every update comes from them."""

    skips_on_device = False

    def __init__(self, master_dtype: torch.dtype, device: torch.device):
        self.master = torch.empty(0, dtype=master_dtype, device=device)
        self.steps_taken = 0  # updates pulled

    def held_tensors(self) -> list[torch.Tensor]:
        return []

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def elementwise_states(self) -> int:
        return 0

    def scalar_state(self) -> dict:
        return {}

    def release_pages(self) -> None:
        pass


class ParameterServerWorker(FlatStrategy):
    """A worker's strategy: the whole model and its gradient, no optimizer state; step() pushes the gradient to
    the servers and pulls the parameters they updated. Its comm is the workers' group (rank 0's initial parameters
    go to every worker, and to the servers)."""

    name = "param-server"
    stage = 0

    def __init__(self, model: nn.Module, comm: Comm, group: ServerGroup, pcfg: ParallelConfig, **kwargs):
        super().__init__(model, comm, pcfg, lambda master, flat, ranges: ServerHeldOptimizer(
            pcfg.master_dtype, master.device), **kwargs)
        self.group = group
        self.sum_dtype = pcfg.reduce_dtype  # what the servers sum in, even for a single worker
        self.bounds = shard_bounds(self.flat.padded_numel, len(group.servers), SquareSums.block(comm.device))
        self.versions = [0] * len(group.servers)  # the version of each shard this worker computes with
        self.steps_pushed = 0
        if comm.rank == 0:  # the servers start from these parameters
            for server, (a, b) in zip(group.servers, self.bounds):
                group.world.send(self.flat.data[a:b], server, INITIAL)

    def _averaged_grad(self) -> torch.Tensor:
        return self.flat.grad

    def _publish(self) -> None:
        pass

    @torch.no_grad()
    def step(self, lr: float | None = None, loss_scale: float = 1.0, max_norm: float | None = None) -> float:
        """Push this step's gradient, pull the parameters; the global gradient norm of the update pulled (NaN: the
        servers skipped it, as data parallel skips a non-finite step)."""
        if self.closed:
            raise RuntimeError("this param-server strategy was closed (its hooks are off the model)")
        self.flat.check_grads_in_place()
        began = time.perf_counter()
        step = self.steps_pushed + 1
        world, servers = self.group.world, self.group.servers
        # Summed in the reduce dtype on the servers, as data parallel's all-reduce sums it.
        grad = self.flat.grad if self.flat.grad.dtype == self.sum_dtype else self.flat.grad.to(self.sum_dtype)
        # One op at a time (each booked for its own seconds, none overlapping): every server gets this step's
        # gradient before any reply is awaited, so no server waits for a worker that waits for another server.
        for s, (server, (a, b)) in enumerate(zip(servers, self.bounds)):
            world.send(torch.tensor([step, self.versions[s], NO_LR if lr is None else lr, loss_scale,
                                     NO_CLIP if max_norm is None else max_norm], dtype=torch.float64), server, HEADER)
            world.send(grad[a:b], server, GRADIENT)
        replies = [torch.empty(2 + len(self.group.workers), dtype=torch.float64) for _ in servers]
        for reply, server, (a, b) in zip(replies, servers, self.bounds):
            world.recv(reply, server, REPLY)
            world.recv(self.flat.data[a:b], server, PARAMS)
        self.steps_pushed = step
        computed_on = min(self.versions)
        self.versions = [int(r[0]) for r in replies]
        self.optimizer.steps_taken = min(self.versions)
        norm = float(replies[0][1])
        self._last_sync = {"param_server": {
            "staleness": step - 1 - computed_on,  # of this step's gradient: updates it did not see
            "version": min(self.versions),  # the parameters pulled for the next step
            "applied_staleness": [int(x) for x in replies[0][2:]],  # each worker's, in the update pulled
            "push_pull_s": time.perf_counter() - began}}
        return norm


class ParameterServer:
    """One server: its shard's master weights and optimizer state; serve() answers the workers until the last
    step's update has reached every one of them."""

    def __init__(self, flat: FlatParameters, group: ServerGroup, pcfg: ParallelConfig, make_optimizer,
                 total_steps: int, sum_dtype: torch.dtype):
        self.group, self.pcfg, self.total = group, pcfg, total_steps
        self.bounds = shard_bounds(flat.padded_numel, len(group.servers), SquareSums.block(flat.data.device))
        self.start, self.stop = self.bounds[group.index]
        self.param_dtype, self.sum_dtype = flat.dtype, sum_dtype
        shard = flat.data[self.start:self.stop]
        group.world.recv(shard, group.workers[0], INITIAL)
        self.optimizer = make_optimizer(shard.to(pcfg.master_dtype), flat, [(self.start, self.stop)])
        self.version = 0
        self.arrived: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}  # step -> worker -> (gradient, version)
        self.settings: dict[int, tuple[float, float, float]] = {}  # step -> (lr, loss scale, clip)
        self.needs: dict[int, int] = {}  # worker -> the version its pending pull waits for
        self.reply = torch.zeros(2 + len(group.workers), dtype=torch.float64)  # of the latest update
        self.params = shard.clone()
        self.sending: list[PendingCollective] = []
        self.staleness_counts: dict[int, int] = {}
        self.skipped = 0

    @torch.no_grad()
    def serve(self) -> dict:
        """Take every worker's gradient of every step (whichever comes first), apply each step's update once it is
        complete, and answer each pull as soon as the version it waits for exists."""
        world, workers, k = self.group.world, self.group.workers, self.group.staleness
        header = torch.empty(5, dtype=torch.float64)
        waited = 0.0
        for _ in range(len(workers) * self.total):
            began = time.perf_counter()
            sender = world.recv_any(header, HEADER)
            step, version, lr, loss_scale, clip = header.tolist()
            step, worker = int(step), workers.index(sender)
            grad = torch.empty(self.stop - self.start, dtype=self.sum_dtype)
            world.recv(grad, sender, GRADIENT)
            waited += time.perf_counter() - began
            self.arrived.setdefault(step, {})[worker] = (grad, int(version))
            self.settings[step] = (lr, loss_scale, clip)
            self.needs[worker] = self.total if step == self.total else step - k
            while len(self.arrived.get(self.version + 1, ())) == len(workers):
                self._apply(self.version + 1)
            self._answer()
        for pending in self.sending:
            pending.wait()
        return {"server": self.group.index, "shard": [self.start, self.stop], "updates": self.version,
                "skipped": self.skipped, "staleness_counts": {str(s): n for s, n in sorted(self.staleness_counts.items())},
                "waited_s": waited}

    def _apply(self, step: int) -> None:
        """The update of `step`: the mean of its gradients (summed in worker order), clipped by the global norm."""
        grads = self.arrived.pop(step)
        lr, loss_scale, clip = self.settings.pop(step)
        mean = grads[0][0]
        for worker in range(1, len(grads)):
            mean += grads[worker][0]
        mean.div_(len(grads))
        norm = float(self._square_sum(mean).sqrt() / loss_scale)
        if math.isfinite(norm):
            limit = self.pcfg.grad_clip if clip == NO_CLIP else clip
            self.optimizer.step(mean, None if math.isnan(lr) else lr, clip_coefficient(norm, limit) / loss_scale)
            self.params = self.optimizer.master.to(self.param_dtype)
        else:  # every server sees the same norm: all skip
            self.skipped += 1
        staleness = [step - 1 - grads[w][1] for w in range(len(grads))]
        for s in staleness:
            self.staleness_counts[s] = self.staleness_counts.get(s, 0) + 1
        self.version = step
        self.reply = torch.tensor([step, norm, *staleness], dtype=torch.float64)

    def _square_sum(self, mean: torch.Tensor) -> torch.Tensor:
        """The whole mean gradient's sum of squares, as data parallel's SquareSums takes it from the whole vector:
        the shards are cut at its chunks' bounds, so every server sums every server's chunks in the same order."""
        dots = SquareSums().block_dots(mean)
        if len(self.bounds) == 1:
            return dots[0] if len(dots) == 1 else sum_in_order(dots, mean.device)
        block = SquareSums.block(mean.device)
        counts = [-(-(b - a) // block) for a, b in self.bounds]
        mine = torch.zeros(max(counts), dtype=torch.float64)
        mine[:len(dots)] = torch.stack(dots)
        every = torch.empty(len(counts) * len(mine), dtype=torch.float64)
        self.group.own.all_gather(every, mine)
        ordered = [d for s, n in enumerate(counts) for d in every[s * len(mine):s * len(mine) + n]]
        return ordered[0] if len(ordered) == 1 else sum_in_order(ordered, mean.device)

    def _answer(self) -> None:
        """Send the newest parameters to every worker whose pull can be answered now."""
        world = self.group.world
        for worker, needs in list(self.needs.items()):
            if needs <= self.version:
                del self.needs[worker]
                rank = self.group.workers[worker]
                self.sending += [world.send_async(self.reply, rank, REPLY),
                                 world.send_async(self.params, rank, PARAMS)]
        still = []
        for pending in self.sending:
            if pending.done():
                pending.wait()  # books it; its tensors may go
            else:
                still.append(pending)
        self.sending = still
