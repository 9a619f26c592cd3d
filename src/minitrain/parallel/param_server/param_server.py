"""Parameter servers (Li et al., OSDI 2014): synchronous, or with bounded staleness (stale-synchronous parallel,
Ho et al., NIPS 2013). Who is which: runtime/servers.py.

Server s holds the master weights and optimizer state of the s-th contiguous shard of the flat parameter vector
(the layout data parallel uses, layout.py). A worker holds the whole model, computes its gradient on its own data,
pushes each shard of it to that shard's server and pulls the updated shards back:

  worker w, step c:  forward and backward on its parameters, whose shard s is at version v_s
                     -> each server: a header (c, v_s, lr, loss scale, clip) and the gradient's shard
                     <- each server, once its version is >= c - K (after the last step: the last version):
                        a header (version, norm, step count, ending, staleness per worker) and the shard
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

Elastic (--ps.elastic, K >= 1): the launcher lets a worker other than worker 0 die and posts its departure in the
run's store; worker 0 watches for it and tells every server (DepartureWatch), since a server that waits for a
message from whichever worker sends first is never told by the transport that one of them died. From then on an
update is complete with the gradients of the workers still there, and is their mean. With two or more servers,
each says which workers' gradients it holds for the update and they apply the ones all of them hold (a worker that
died between its pushes to two servers reached only one). The replies say whose gradients went into the update,
and a save then meets over those workers alone (save_topology). The one that left is not replaced: the others go
on with their own data shards, so its shard of every later batch is skipped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from ...runtime.comm import CollectiveError, Comm, PendingCollective
from ...runtime.launch import left_key
from ...runtime.servers import ServerGroup, shard_bounds
from ..core.config import ParallelConfig
from ..core.strategy import FlatStrategy
from ..core.flat_parameters import FlatParameters
from ..core.norms import SquareSums, clip_coefficient, sum_in_order

# A message is a header (float64: kind, step, version, lr, loss scale, clip, epoch, groups), then what its kind
# brings (a push through the API: its gradient, then the learning rate of each of its `groups` param groups). A
# server takes headers from whichever worker sends first; the rest of a message comes from that worker on its own
# tag. The epoch counts the checkpoints a worker has loaded: a request made after a load (a loss spike's rollback)
# waits at the server until worker 0's LOAD of that state has come, whichever arrives first.
HEADER, GRADIENT, REPLY, PARAMS, STATE, SUMMARY, GROUP_LRS = 1, 2, 3, 4, 5, 6, 7  # tags
HEADER_LEN = 8
PUSH, SYNC, FETCH, START, LOAD, DONE, LEFT = range(7)  # kinds (LEFT: step is the worker that left)
NO_LR, NO_CLIP = math.nan, -1.0  # "the optimizer's own lr", "the run's grad_clip"
# A reply's norm when no update has been applied since the start or a load (a norm is never negative; NaN means the
# update was skipped, non-finite): under K > 0 the first K pulls come before any update.
NO_UPDATE_YET = -1.0
# The optimizer state a server holds (train/optim.py's FlatAdamW), by the names checkpoints give it.
STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


def _header(kind: int, step: int = 0, version: int = 0, lr: float = NO_LR, loss_scale: float = 1.0,
            clip: float = NO_CLIP, epoch: int = 0, groups: int = 0) -> torch.Tensor:
    return torch.tensor([kind, step, version, lr, loss_scale, clip, epoch, groups], dtype=torch.float64)


class ServerHeldOptimizer:
    """A worker's stand-in for the optimizer its servers hold. Between steps it holds nothing; for a save, worker 0
    holds the state fetched from the servers (state_tensors), and on a resume the state read for them, until it has
    gone to them."""

    skips_on_device = False
    store = None  # nothing offloaded here

    def __init__(self, master_dtype: torch.dtype, device: torch.device):
        self.master = torch.empty(0, dtype=master_dtype, device=device)
        self.steps_taken = 0  # updates the servers applied (skipped ones not counted), as of the last reply
        self.held: dict[str, torch.Tensor] = {}

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.held.values())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.held

    def elementwise_states(self) -> int:
        return 0

    def scalar_state(self) -> dict:
        return {"steps_taken": self.steps_taken}

    def load_state(self, tensors, scalars: dict) -> None:
        self.held = {name: tensors[name].to(self.master.dtype) for name in STATE_NAMES}
        self.steps_taken = int(scalars["steps_taken"])

    def release_pages(self) -> None:
        self.held = {}


class DepartureWatch:
    """Worker 0's thread under --ps.elastic: it looks in the run's store for the workers the launcher let leave
    (runtime/launch.py) and tells every server, which may be waiting for such a worker's gradient. It runs until
    the servers have reported (ps_run.py): a worker may die after the last step, before its DONE."""

    POLL_S = 0.1

    def __init__(self, group: ServerGroup):
        self.group = group
        # A Comm of this thread's own (the training thread's keeps its own books), unwatched: a send to a server
        # that has gone fails here without ending the run; the launcher reports that server.
        self.comm = group.world.unwatched()
        self.told: set[int] = set()  # worker indices
        self.stop = threading.Event()
        # The rendezvous store, which rank 0 (this one) holds: the launcher posts there.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=30))
        self.thread = threading.Thread(target=self._watch, args=(store,), name="minitrain-departures", daemon=True)
        self.thread.start()

    def _watch(self, store) -> None:
        keys = {w: left_key(rank) for w, rank in enumerate(self.group.workers) if w}
        while not self.stop.wait(self.POLL_S):
            for worker, key in keys.items():
                try:
                    if worker in self.told or not store.check([key]):
                        continue
                except RuntimeError:  # the store is rank 0's own: gone only as this process ends
                    return
                self.told.add(worker)
                header = _header(LEFT, worker)
                # To every server at once: one may not receive before another has (its update's all-gather waits
                # for a server that waits for this news). A whole message of its own, told apart from the training
                # thread's by its kind.
                with contextlib.suppress(CollectiveError):  # a server gone: the launcher ends the run
                    for send in [self.comm.send_async(header, server, HEADER) for server in self.group.servers]:
                        send.wait()

    def close(self) -> None:
        # Not waiting for a send still held: a blocking send waits for its receive, and a server that had every
        # worker's DONE before the departure came no longer receives (the send fails when that server exits).
        self.stop.set()
        self.thread.join(timeout=2 * self.POLL_S)


class ParameterServerWorker(FlatStrategy):
    """A worker's strategy: the whole model and its gradient, no optimizer state; step() pushes the gradient to
    the servers and pulls the parameters they updated. Its comm is the workers' group (rank 0's initial parameters
    go to every worker, and to the servers with the first step)."""

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
        self.epoch = 0  # checkpoints loaded (resumed_at)
        self._servers_started = comm.rank != 0  # worker 0 sends them their first state (START or LOAD)
        self.in_update = list(range(len(group.workers)))  # the workers whose gradients went into the last update
        self._survivors: tuple[list[int], Comm] | None = None  # the group a save meets over once workers have left

    def _averaged_grad(self) -> torch.Tensor:
        return self.flat.grad

    def _publish(self, published: torch.Tensor | None) -> None:
        pass

    def _send_all(self, header: torch.Tensor, pieces: list[torch.Tensor] = (), tag: int = STATE) -> None:
        """header to every server, then each piece's shard (pieces: full-length vectors), one op at a time."""
        for server, (a, b) in zip(self.group.servers, self.bounds):
            self.group.world.send(header, server, HEADER)
            for piece in pieces:
                self.group.world.send(piece[a:b].contiguous(), server, tag)

    def _start_servers(self) -> None:
        """Worker 0, before its first request: the servers' starting parameters (the master is made from them)."""
        if not self._servers_started:
            self._send_all(_header(START), [self.flat.data], PARAMS)
            self._servers_started = True

    def _pull(self, with_state: bool = False) -> torch.Tensor:
        """Every server's reply and shard of the parameters (and of its optimizer state); server 0's reply header."""
        world, workers = self.group.world, self.group.workers
        replies = [torch.empty(4 + len(workers), dtype=torch.float64) for _ in self.bounds]
        if with_state:
            n = self.flat.padded_numel
            self.optimizer.held = {name: torch.empty(n, dtype=self.optimizer.master.dtype) for name in STATE_NAMES}
        for reply, server, (a, b) in zip(replies, self.group.servers, self.bounds):
            world.recv(reply, server, REPLY)
            world.recv(self.flat.data[a:b], server, PARAMS)
            for name in STATE_NAMES if with_state else ():
                world.recv(self.optimizer.held[name][a:b], server, STATE)
        self.versions = [int(r[0]) for r in replies]
        self.in_update = [w for w, s in enumerate(replies[0][4:].tolist()) if s >= 0]
        self.optimizer.steps_taken = int(replies[0][2])
        self.ending = self.ending or any(bool(r[3]) for r in replies)
        return replies[0]

    @torch.no_grad()
    def step(self, lr: float | None = None, loss_scale: float = 1.0, max_norm: float | None = None, *,
             group_lrs: list[float] | None = None) -> float:
        """Push this step's gradient, pull the parameters; the global gradient norm of the update pulled (NaN: the
        servers skipped it, as data parallel skips a non-finite step; before any update is in, under K > 0: this
        worker's own gradient's norm, which is not a skipped step). group_lrs: the learning rate of each param
        group of the user's optimizer on the servers (the API's; the CLI gives `lr`, or keeps the servers' own)."""
        if self.closed:
            raise RuntimeError("this param-server strategy was closed (its hooks are off the model)")
        self.flat.grads_in_place()
        self._start_servers()
        self.optimizer.release_pages()  # a save's copy of the servers' state is written by now
        began = time.perf_counter()
        step = self.steps_pushed + 1
        # Summed in the reduce dtype on the servers, as data parallel's all-reduce sums it.
        grad = self.flat.grad if self.flat.grad.dtype == self.sum_dtype else self.flat.grad.to(self.sum_dtype)
        # One op at a time (each booked for its own seconds, none overlapping): every server gets this step's
        # gradient before any reply is awaited, so no server waits for a worker that waits for another server.
        for s, (server, (a, b)) in enumerate(zip(self.group.servers, self.bounds)):
            header = _header(PUSH, step, self.versions[s], NO_LR if lr is None else lr, loss_scale,
                             NO_CLIP if max_norm is None else max_norm, self.epoch, len(group_lrs or ()))
            self.group.world.send(header, server, HEADER)
            self.group.world.send(grad[a:b], server, GRADIENT)
            if group_lrs:
                self.group.world.send(torch.tensor(group_lrs, dtype=torch.float64), server, GROUP_LRS)
        computed_on = min(self.versions)
        reply = self._pull()
        self.steps_pushed = step
        self._last_sync = {"param_server": {
            "staleness": step - 1 - computed_on,  # of this step's gradient: updates it did not see
            "version": min(self.versions),  # the parameters pulled for the next step
            "applied_staleness": [int(x) for x in reply[4:]],  # each worker's, in the update pulled
            "push_pull_s": time.perf_counter() - began}}
        if reply[1] == NO_UPDATE_YET:
            return float(SquareSums()(grad).sqrt() / loss_scale)
        return float(reply[1])

    @torch.no_grad()
    def wait_for_last_update(self, with_state: bool = False) -> bool:
        """Take the parameters of the update of this worker's last step, once it is in (the end of a user's loop:
        under K > 0 a worker ahead waits here for the others), and with_state the servers' optimizer state. False
        when it never came: another worker ended first, so that update could not be complete."""
        self._start_servers()
        self._send_all(_header(FETCH if with_state else SYNC, self.steps_pushed, epoch=self.epoch))
        self._pull(with_state=with_state)
        return min(self.versions) >= self.steps_pushed

    @torch.no_grad()
    def settle_for_save(self) -> None:
        """Every worker waits for the update of its last step and takes its parameters (a save is a point where
        the workers agree, whatever K); worker 0 also takes the servers' optimizer state, which it writes."""
        self.wait_for_last_update(with_state=self.comm.rank == 0)

    @torch.no_grad()
    def resumed_at(self, step: int) -> None:
        """The trainer loaded a checkpoint of `step`: worker 0 sends the servers their shards of the optimizer state
        it read (load_local), which the servers take from here on."""
        self.steps_pushed, self.versions, self.epoch = step, [step] * len(self.bounds), self.epoch + 1
        if self.comm.rank == 0:
            state = self.optimizer.held
            self._send_all(_header(LOAD, step, lr=self.optimizer.steps_taken, epoch=self.epoch),
                           [state[n] for n in STATE_NAMES])
            self._servers_started = True
        self.optimizer.release_pages()

    def save_topology(self, topo):
        """After settle_for_save: the workers whose gradients went into the update pulled, every one of them unless
        some have left (--ps.elastic); then a group of their own, which they make alone."""
        if len(self.in_update) == len(self.group.workers):
            return topo
        ranks = [self.group.workers[w] for w in self.in_update]
        if self._survivors is None or self._survivors[0] != ranks:
            group = dist.new_group(ranks, use_local_synchronization=True)
            comm = Comm(ranks.index(self.group.world.rank), len(ranks), group, topo.device, "ps-survivors",
                        topo.watch)
            topo.opened.append(comm)
            self._survivors = (ranks, comm)
        comm = self._survivors[1]
        return dataclasses.replace(topo, rank=comm.rank, world_size=comm.world_size, dp=comm)

    def close(self) -> None:
        """Off the model, and the servers told this worker is done (they end when every worker is)."""
        if not self.closed:
            with contextlib.suppress(CollectiveError):  # a server already gone: the run is ending with an error
                self._send_all(_header(DONE, self.steps_pushed))
        super().close()


class ParameterServer:
    """One server: its shard's master weights and optimizer state; serve() answers the workers until every one is
    done."""

    def __init__(self, flat: FlatParameters, group: ServerGroup, pcfg: ParallelConfig, make_optimizer,
                 total_steps: int | None, sum_dtype: torch.dtype, faults=None):
        """total_steps: the run's last step, whose update every worker waits for (None: not known, a user's loop).
        faults: the run's deliberate faults (train/faults.py), fired as an update starts on this server's rank."""
        self.group, self.pcfg, self.total, self.faults = group, pcfg, total_steps, faults
        # Under --ps.elastic a transfer with a worker that died fails here, which must not end the run: the watch
        # would take it for the run's failure and end every rank. The workers' own waits stay watched.
        self.world = group.world.unwatched() if group.elastic else group.world
        self.bounds = shard_bounds(flat.padded_numel, len(group.servers), SquareSums.block(flat.data.device))
        self.start, self.stop = self.bounds[group.index]
        self.param_dtype, self.sum_dtype = flat.dtype, sum_dtype
        self.params = flat.data[self.start:self.stop].clone()  # what the workers pull, in their dtype
        # Copies, never views of each other: a send in flight keeps the parameters it was given.
        self.optimizer = make_optimizer(self.params.to(pcfg.master_dtype, copy=True), flat, [(self.start, self.stop)])
        self.started = False  # the starting state has come (START or LOAD): nothing is answered before
        self.version = 0
        self.arrived: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}  # step -> worker -> (gradient, version)
        # step -> (lr, loss scale, clip, each param group's lr or None)
        self.settings: dict[int, tuple[float, float, float, list[float] | None]] = {}
        self.needs: dict[int, tuple[int, bool]] = {}  # worker -> (the version its pull waits for, with the state)
        self.last = (NO_UPDATE_YET, [0] * len(group.workers))  # the latest update's norm and staleness per worker
        self.done: set[int] = set()
        self.left: set[int] = set()  # workers that left (--ps.elastic): updates are complete without them
        self.last_in: dict[int, int] = {}  # worker -> the last update its gradient went into
        # A worker has gone (done, stopped): under K > 0 the others may still be short of the last step, and no step
        # it did not push can be complete. Every pull is then answered at once, flagged, and the workers stop. The
        # steps every worker pushed are still applied, on every server alike (their all-gathers must match).
        self.ending = False
        self.epoch = 0  # checkpoints loaded (LOAD)
        self.deferred: list[tuple] = []  # requests of a later epoch than this server's, until its LOAD comes
        self.sending: list[tuple[PendingCollective, int]] = []  # (a send in flight, the worker it goes to)
        self.staleness_counts: dict[int, int] = {}
        self.skipped = 0

    @torch.no_grad()
    def serve(self) -> dict:
        """Take the workers' messages as they come: apply each step's update once every gradient of it is in, and
        answer each pull as soon as the version it waits for exists."""
        world, workers = self.world, self.group.workers
        header = torch.empty(HEADER_LEN, dtype=torch.float64)
        waited = 0.0
        while len(self.done | self.left) < len(workers):
            began = time.perf_counter()
            sender = world.recv_any(header, HEADER)
            kind, step, version, lr, loss_scale, clip, epoch, groups = header.tolist()
            kind, step, worker = int(kind), int(step), workers.index(sender)
            if kind == LEFT:
                self._leave(step)
            elif worker in self.left:  # what it sent before it died, read after: its gradient may be cut short
                continue
            elif kind in (PUSH, SYNC, FETCH):
                grad = None
                if kind == PUSH:
                    grad = torch.empty(self.stop - self.start, dtype=self.sum_dtype)
                    group_lrs = torch.empty(int(groups), dtype=torch.float64)
                    try:
                        world.recv(grad, sender, GRADIENT)
                        if groups:
                            world.recv(group_lrs, sender, GROUP_LRS)
                    except CollectiveError:
                        if not self.group.elastic:
                            raise
                        continue  # it died sending: its departure is on its way
                request = (kind, step, int(version), (lr, loss_scale, clip, group_lrs.tolist() if groups else None),
                           worker, grad)
                if epoch > self.epoch:  # made after a load whose state has not come yet
                    self.deferred.append(request)
                else:
                    self._take(*request)
            elif kind == START:
                world.recv(self.params, sender, PARAMS)
                self.optimizer.master.copy_(self.params)
                self.started = True
            elif kind == LOAD:
                self._load(sender, step, int(lr))
                self.epoch = int(epoch)
                for request in self.deferred:
                    self._take(*request)
                self.deferred = []
            elif kind == DONE and self.group.elastic and worker and (self.total is None or step < self.total):
                self._leave(worker)  # stopped early (a signal, an error): elastic, the others go on without it
            elif kind == DONE:
                self.done.add(worker)
                self.ending = True
            waited += time.perf_counter() - began
            while self.started and self._complete(self.version + 1):
                self._apply(self.version + 1)
            if self.started:
                self._answer()
        for pending, worker in self.sending:
            self._finish(pending, worker)
        return {"server": self.group.index, "shard": [self.start, self.stop], "updates": self.version,
                "skipped": self.skipped, "waited_s": waited,
                "staleness_counts": {str(s): n for s, n in sorted(self.staleness_counts.items())},
                "left": [{"worker": w, "rank": workers[w], "last_update": self.last_in.get(w, 0)}
                         for w in sorted(self.left)]}

    def _complete(self, step: int) -> bool:
        """Every gradient of `step` is in, but those of workers that left."""
        arrived = self.arrived.get(step, {})
        return bool(arrived) and all(w in arrived for w in range(len(self.group.workers)) if w not in self.left)

    def _leave(self, worker: int) -> None:
        """A worker left (--ps.elastic): nothing more is answered to it or waited for from it; a gradient of it
        already in goes into its update where every server has it (_agreed)."""
        self.left.add(worker)
        self.needs.pop(worker, None)
        self.deferred = [request for request in self.deferred if request[4] != worker]

    def _take(self, kind: int, step: int, version: int, settings: tuple, worker: int, grad: torch.Tensor | None
              ) -> None:
        """A worker's push (its gradient for `step`, computed on `version`; then its pull) or pull."""
        if kind == PUSH:
            self.arrived.setdefault(step, {})[worker] = (grad, version)
            self.settings[step] = settings
            self.needs[worker] = (self.total if step == self.total else step - self.group.staleness, False)
        else:
            self.needs[worker] = (step, kind == FETCH)

    def _load(self, sender: int, step: int, steps_taken: int) -> None:
        """A checkpoint's state for this shard (worker 0 read it): the servers continue from `step`."""
        n = self.stop - self.start
        state = {name: torch.empty(n, dtype=self.optimizer.master.dtype) for name in STATE_NAMES}
        for name in STATE_NAMES:
            self.world.recv(state[name], sender, STATE)
        self.optimizer.load_state(state, {"steps_taken": steps_taken})
        self.params = self.optimizer.master.to(self.param_dtype, copy=True)
        self.version, self.started = step, True
        self.last = (NO_UPDATE_YET, self.last[1])
        if self.faults is not None:
            self.faults.armed = False  # deliberate faults never fire in a run that loaded a checkpoint

    def _apply(self, step: int) -> None:
        """The update of `step`: the mean of its gradients (summed in worker order), clipped by the global norm."""
        if self.faults is not None:
            self.faults.at_step_start(step)
        grads = self.arrived.pop(step)
        lr, loss_scale, clip, group_lrs = self.settings.pop(step)
        included = self._agreed(sorted(grads))
        mean = grads[included[0]][0]
        for worker in included[1:]:
            mean += grads[worker][0]
        mean.div_(len(included))
        norm = float(self._square_sum(mean).sqrt() / loss_scale)
        if math.isfinite(norm):
            limit = self.pcfg.grad_clip if clip == NO_CLIP else clip
            for group, group_lr in zip(self.optimizer.inner.param_groups if group_lrs else (), group_lrs or ()):
                group["lr"] = group_lr  # the user's optimizer (API): its scheduler runs on the workers
            self.optimizer.step(mean, None if math.isnan(lr) else lr, clip_coefficient(norm, limit) / loss_scale)
            self.params = self.optimizer.master.to(self.param_dtype, copy=True)
        else:  # every server sees the same norm: all skip
            self.skipped += 1
        # -1: not in this update (a worker that left)
        staleness = [step - 1 - grads[w][1] if w in included else -1 for w in range(len(self.group.workers))]
        for w in included:
            self.staleness_counts[staleness[w]] = self.staleness_counts.get(staleness[w], 0) + 1
            self.last_in[w] = step
        self.version, self.last = step, (norm, staleness)

    def _agreed(self, held: list[int]) -> list[int]:
        """The workers whose gradients go into an update: those every server holds one of (collective over the
        servers, elastic runs only: otherwise every server holds every worker's)."""
        if not self.group.elastic or len(self.group.servers) == 1:
            return held
        mine = torch.zeros(len(self.group.workers), dtype=torch.float64)
        mine[held] = 1.0
        every = torch.empty(len(self.group.servers) * len(mine), dtype=torch.float64)
        self.group.own.all_gather(every, mine)
        return [w for w in held if bool(every.view(len(self.group.servers), -1)[:, w].all())]

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
        """Send the newest parameters (and the optimizer state, where asked) to every worker whose pull can be
        answered now. Each send keeps its own tensor: the next update makes new ones."""
        world = self.world
        norm, staleness = self.last
        reply = torch.tensor([self.version, norm, self.optimizer.steps_taken, self.ending, *staleness],
                             dtype=torch.float64)
        for worker, (needs, with_state) in list(self.needs.items()):
            if needs > self.version and not self.ending:
                continue
            del self.needs[worker]
            rank, sends = self.group.workers[worker], []
            try:
                sends += [world.send_async(reply, rank, REPLY), world.send_async(self.params, rank, PARAMS)]
                state = self.optimizer.state_tensors()
                sends += [world.send_async(state[name].clone(), rank, STATE) for name in STATE_NAMES if with_state]
            except CollectiveError:
                if not self.group.elastic:
                    raise  # elastic: a worker that died, whose departure is on its way
            self.sending += [(pending, worker) for pending in sends]
        still = []
        for pending, worker in self.sending:
            if pending.done():
                self._finish(pending, worker)  # books it; its tensors may go
            else:
                still.append((pending, worker))
        self.sending = still

    def _finish(self, pending: PendingCollective, worker: int) -> None:
        """Wait for a send to `worker`; under --ps.elastic one to a worker that died is dropped (the launcher posts
        its departure, which comes here as LEFT)."""
        try:
            pending.wait()
        except CollectiveError:
            if not self.group.elastic:
                raise
