"""A parameter-server worker: the strategy a worker trains with (protocol.py says what it sends and gets)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from ...runtime.comm import CollectiveError, Comm
from ...runtime.launch import left_key
from ...runtime.servers import ServerGroup, shard_bounds
from ..core.config import ParallelConfig
from ..core.strategy import FlatStrategy
from ..core.norms import SquareSums

from .protocol import (DONE, FETCH, GRADIENT, GROUP_LRS, HEADER, LEFT, LOAD, NO_CLIP, NO_LR, NO_UPDATE_YET, PARAMS,
                       PUSH, REPLY, START, STATE, STATE_NAMES, SYNC, _header)


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
             group_lrs: list[float] | None = None) -> torch.Tensor:
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
            return SquareSums()(grad).sqrt() / loss_scale
        return reply[1].clone()

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
