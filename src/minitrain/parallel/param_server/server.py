"""A parameter server: holds a shard of the master weights and optimizer state, applies each step's update once
every worker's gradient is in (protocol.py)."""
from __future__ import annotations

import math
import time

import torch

from ...runtime.comm import CollectiveError, PendingCollective
from ...runtime.servers import ServerGroup, shard_bounds
from ..core.config import ParallelConfig
from ..core.flat_parameters import FlatParameters
from ..core.norms import SquareSums, clip_coefficient, sum_in_order

from .protocol import (DONE, FETCH, GRADIENT, GROUP_LRS, HEADER, HEADER_LEN, LEFT, LOAD, NO_CLIP, NO_UPDATE_YET,
                       PARAMS, PUSH, REPLY, START, STATE, STATE_NAMES, SYNC)


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
            self.faults.on_resume()  # without a ledger, deliberate faults never fire in a run that loaded a checkpoint

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
