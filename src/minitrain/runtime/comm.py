"""The only module that calls torch.distributed collectives: Comm, one per process group.

Every call goes through `Comm._run` (or `_launch`, for an async one), whose OpLedger (op_stats.py) counts calls,
payload bytes and wall seconds per op; step metrics take deltas of these counters. A Comm of world size 1 needs
no process group: each op is the identity (a copy where an output buffer is given) and nothing is counted, since
nothing moves.

Payload bytes per call: all_reduce, broadcast, send, recv (and each of an exchange's): the tensor;
reduce_scatter: the full input; all_gather: the full output.

Async collectives (`*_async`) return a PendingCollective (pending.py), which books their *in-flight* time.

With a CollectiveWatch (runtime/watch.py; a Comm of a process group always has one when Topology made it),
every collective also gets a fingerprint (group, sequence number, op, shapes, dtype, call site), and the watch
hears when this rank enters and leaves it: a hang is then diagnosed by naming the rank that is elsewhere, and
a failing collective's error (collective_error.py) carries that diagnosis.

Every collective the project issues is a short method of Comm here, so that one file shows what crosses the
network and the watch sees every op; call_site() skips this file to name the caller.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from .clock import clock_for
from .collective_error import CollectiveError, collective_failure
from .op_stats import OpLedger, OpStats
from .pending import AllOf, PendingCollective

# What importers take from here besides Comm: its errors, what totals() returns, an async op's handle.
__all__ = ["CollectiveError", "Comm", "OpStats", "PendingCollective", "call_site", "concrete_device"]

# torch 2.13 renamed the single-tensor collectives; older releases (>= 2.4) have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def concrete_device(device: torch.device | str) -> torch.device:
    """`cuda` names the current GPU, but a tensor made there says `cuda:0`: the index made explicit, so that
    devices compare equal to the tensors' own."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Comm:
    """One process group's collectives, each a short method; counted, timed and watched (see the module's text)."""

    def __init__(self, rank: int = 0, world_size: int = 1, group=None, device: torch.device | str = "cpu",
                 name: str = "world", watch=None, issue_alone: bool = False):
        """name: the group's kind ("world", "dp", "tp", "pp"), as fingerprints and diagnoses call it.
        watch: this process's CollectiveWatch; a Comm of one rank (or without a group) records nothing.
        issue_alone: a group of one rank still hands every collective to its backend (by default it copies or
        does nothing): NCCL's path, its streams and device-event timings, run and measured on a single GPU."""
        self.rank, self.world_size, self.group, self.name = rank, world_size, group, name
        self.alone = world_size == 1 and not (issue_alone and group is not None)  # no backend call: local copies
        self.device = concrete_device(device)  # where this group's tensors must live (cuda for NCCL)
        self.ledger = OpLedger()
        self._gloo = group is not None and dist.get_backend(group) == "gloo"
        self.watch = watch if group is not None and world_size > 1 else None
        self._track = self.watch.track(name, dist.get_process_group_ranks(group)) if self.watch else None
        self._released = False
        self._clock = None  # made on first use (a CUDA clock needs the device): clock.py
        self.tag: str | None = None  # set around a region whose collectives' seconds are wanted apart (take_tagged)

    @property
    def group_track(self):
        """This group's GroupTrack in the watch (None without one): its members and its counts."""
        return self._track

    def unwatched(self) -> "Comm":
        """The same group without the collective watch: an op that fails raises at once, undiagnosed, and ends no
        other rank (a parameter server's transfers with workers that may die, --ps.elastic)."""
        return Comm(self.rank, self.world_size, self.group, self.device, self.name)

    @property
    def clock(self):
        if self._clock is None:
            self._clock = clock_for(self.device)
        return self._clock

    @clock.setter
    def clock(self, clock) -> None:
        self._clock = clock

    def _fingerprint(self, op: str, tensors: tuple) -> tuple | None:
        """The next collective's fingerprint (None without a watch); refuses a Comm whose group was released."""
        if self._released:  # group=None would otherwise mean whichever default group exists by then
            raise CollectiveError(f"{op} on {self.name} after its topology was closed (Topology.close)")
        return self._track.issue(op, tensors, call_site()) if self._track is not None else None

    def _on_device(self, *tensors: torch.Tensor) -> None:
        """Every tensor a collective is given lives on this group's device (cuda for NCCL): a CPU tensor handed to
        NCCL fails deep in the backend, and where one rank only copies, the bug would hide until there are two."""
        for t in tensors:
            if t.device != self.device:
                raise CollectiveError(f"a {t.device} tensor was handed to a collective of the {self.name} group, whose "
                                      f"tensors live on {self.device}")

    def release(self) -> None:
        """Let go of the process group (Topology.close), so its threads can end with it; a later collective
        on this Comm raises CollectiveError."""
        self.group, self._released = None, True

    def _run(self, op: str, nbytes: int, fn, *tensors: torch.Tensor) -> None:
        fp = self._fingerprint(op, tensors)
        if fp is not None:
            self.watch.enter(fp)
        clock = self.clock
        start = clock.mark()
        try:
            fn()
        except RuntimeError as e:  # gloo reports timeouts and dead peers as RuntimeError
            raise self.failure(op, nbytes, e, fp) from e
        finally:  # whatever ends it (an interrupt too), this rank is no longer in it
            if fp is not None:
                self.watch.leave(fp)
        end = clock.mark()  # on a GPU: the compute stream waits for the collective, so this fires after it
        if fp is not None and clock.on_device:  # the host returned at once; the device is in it until `end`
            self.watch.outstanding(fp, lambda: clock.ready(end))
        self.record(op, nbytes, start, end)

    @property
    def stats(self) -> dict[str, OpStats]:
        """Calls, bytes and seconds so far, per op."""
        return self.ledger.stats

    def record(self, op: str, nbytes: int, began, ended) -> None:
        """Book a collective between two marks of the clock (op_stats.py), under the current tag."""
        self.ledger.record(self.clock, op, nbytes, began, ended, self.tag)

    def take_tagged(self, tag: str) -> float:
        """Seconds of the collectives recorded while `tag` was set, since the last take (booked ones only: on a GPU,
        read after the step's host synchronisation)."""
        return self.ledger.take_tagged(self.clock, tag)

    def failure(self, op: str, nbytes: int, cause: Exception, fp: tuple | None = None) -> CollectiveError:
        """The error to raise for a collective that raised `cause` (collective_error.py)."""
        return collective_failure(self, op, nbytes, cause, fp)

    def totals(self) -> OpStats:
        """Sum over all ops so far (take differences for per-step figures); on a GPU, of those whose device marks
        are done (all of them after the step's host synchronisation)."""
        return self.ledger.totals(self.clock)

    # --- collectives -----------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._on_device(tensor)
        if not self.alone:
            # group_src: `src` is a rank of this group, which is not the global rank in a sub-group.
            self._run("broadcast", _nbytes(tensor), lambda: dist.broadcast(tensor, group=self.group, group_src=src),
                      tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """In place: tensor <- sum over ranks."""
        self._on_device(tensor)
        if not self.alone:
            self._run("all_reduce", _nbytes(tensor), lambda: dist.all_reduce(tensor, group=self.group), tensor)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """In place: tensor <- elementwise max over ranks."""
        self._on_device(tensor)
        if not self.alone:
            self._run("all_reduce", _nbytes(tensor),
                      lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group), tensor)

    def all_reduce_min(self, tensor: torch.Tensor) -> None:
        """In place: tensor <- elementwise min over ranks."""
        self._on_device(tensor)
        if not self.alone:
            self._run("all_reduce", _nbytes(tensor),
                      lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group), tensor)

    def _launch(self, op: str, nbytes: int, start, *tensors: torch.Tensor,
                payload: torch.Tensor | None = None) -> PendingCollective:
        """Start an async collective (start() returns its Work); returns at once. Its fingerprint is taken
        here, in issue order; the watch counts this rank as in it only while it waits for it."""
        fp = self._fingerprint(op, tensors)
        launched = self.clock.mark()
        try:
            work = start()
        except RuntimeError as e:
            raise self.failure(op, nbytes, e, fp) from e
        return PendingCollective(self, op, nbytes, work, payload=payload, fp=fp, launched=launched)

    def all_reduce_sum_async(self, tensor: torch.Tensor) -> PendingCollective:
        """Start an in-place sum over ranks; returns at once. Call .wait() before using tensor."""
        self._on_device(tensor)
        if self.alone:
            return PendingCollective(self, "all_reduce", 0)
        return self._launch("all_reduce", _nbytes(tensor),
                            lambda: dist.all_reduce(tensor, group=self.group, async_op=True), tensor)

    def reduce_scatter_sum(self, shard_out: torch.Tensor, full_in: torch.Tensor) -> None:
        """shard_out <- this rank's 1/N slice of (sum over ranks of full_in)."""
        self._on_device(shard_out, full_in)
        if self.alone:
            shard_out.copy_(full_in)
            return
        self._run("reduce_scatter", _nbytes(full_in),
                  lambda: _reduce_scatter_single(shard_out, full_in, group=self.group), full_in, shard_out)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor) -> None:
        """full_out <- concatenation of every rank's shard_in, in rank order."""
        self._on_device(full_out, shard_in)
        if self.alone:
            full_out.copy_(shard_in)
            return
        self._run("all_gather", _nbytes(full_out), lambda: self._start_all_gather(full_out, shard_in).wait(),
                  full_out, shard_in)

    def reduce_scatter_sum_async(self, shard_out: torch.Tensor, full_in: torch.Tensor) -> PendingCollective:
        """Async reduce_scatter_sum; shard_out is valid after .wait()."""
        self._on_device(shard_out, full_in)
        if self.alone:
            shard_out.copy_(full_in)
            return PendingCollective(self, "reduce_scatter", 0)
        return self._launch("reduce_scatter", _nbytes(full_in), lambda: _reduce_scatter_single(
            shard_out, full_in, group=self.group, async_op=True), full_in, shard_out)

    def all_gather_async(self, full_out: torch.Tensor, shard_in: torch.Tensor) -> PendingCollective:
        """Async all_gather; full_out is valid after .wait()."""
        self._on_device(full_out, shard_in)
        if self.alone:
            full_out.copy_(shard_in)
            return PendingCollective(self, "all_gather", 0)
        return self._launch("all_gather", _nbytes(full_out), lambda: self._start_all_gather(full_out, shard_in),
                            full_out, shard_in)

    def _start_all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor):
        """Start an all_gather; returns its Work. On gloo, above 1 MiB, as one broadcast from each rank
        into its slice of full_out: gloo's own all_gather goes through temporaries, which costs it at that size
        (below, it is as fast or faster)."""
        if not (self._gloo and _nbytes(full_out) > 1 << 20):
            return _all_gather_single(full_out, shard_in, group=self.group, async_op=True)
        slices = full_out.view(self.world_size, -1)
        slices[self.rank].copy_(shard_in)
        return AllOf([dist.broadcast(slices[r], group=self.group, group_src=r, async_op=True)
                       for r in range(self.world_size)])

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Block j of inp (split into world_size equal blocks) goes to rank j; out holds the
        blocks every rank sent to this one, in rank order."""
        self._on_device(out, inp)
        if self.alone:
            out.copy_(inp)
            return
        self._run("all_to_all", _nbytes(inp), lambda: dist.all_to_all_single(out, inp, group=self.group), inp)

    def all_to_all_uneven(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                          in_splits: list[int]) -> None:
        """Rows of inp in blocks of in_splits[j] go to rank j; out receives out_splits[i] rows from rank i, in rank
        order (a mixture of experts' tokens to and from their experts' ranks). The sizes differ between ranks, so
        the collective's fingerprint is taken of the rows' shape without their number (the same on every rank)."""
        self._on_device(out, inp)
        if self.alone:
            out.copy_(inp)
            return
        row_shape = inp.new_empty((0, *inp.shape[1:]))
        self._run("all_to_all", _nbytes(inp), lambda: dist.all_to_all_single(
            out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group), row_shape)

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's small 1-D `row`, stacked into a CPU tensor (world_size, len(row)) on
        every rank. Moves through the group's device, so callers may build rows on the CPU."""
        return self.gather_rows_on_device(row).cpu()

    def gather_rows_on_device(self, row: torch.Tensor) -> torch.Tensor:
        """gather_rows, the result left on the group's device: the host need not wait for it."""
        row = row.to(self.device).contiguous()
        out = torch.empty(self.world_size * row.numel(), dtype=row.dtype, device=self.device)
        self.all_gather(out, row)
        return out.view(self.world_size, -1)

    def gather_ragged(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints, of any length, on every rank (two fixed-size gathers)."""
        lengths = self.gather_rows(torch.tensor([len(values)], dtype=torch.int64))[:, 0].tolist()
        padded = torch.zeros(max(lengths), dtype=torch.int64)
        padded[:len(values)] = torch.tensor(values, dtype=torch.int64)
        return [row[:n] for row, n in zip(self.gather_rows(padded).tolist(), lengths)]

    def gather_json(self, obj) -> list:
        """Every rank's JSON-able `obj`, on every rank (as UTF-8 bytes: no pickles between ranks either)."""
        return [json.loads(bytes(row).decode()) for row in self.gather_ragged(list(json.dumps(obj).encode()))]

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._on_device(tensor)
        self._run("send", _nbytes(tensor), lambda: dist.send(tensor, group=self.group, group_dst=dst, tag=tag),
                  tensor)

    def send_async(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> PendingCollective:
        """Start sending; returns at once, the tensor kept alive until wait() (do not change it before)."""
        self._on_device(tensor)
        return self._launch("send", _nbytes(tensor), lambda: dist.isend(tensor, group=self.group, group_dst=dst,
                                                                         tag=tag), tensor, payload=tensor)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self._on_device(tensor)
        self._run("recv", _nbytes(tensor), lambda: dist.recv(tensor, group=self.group, group_src=src, tag=tag),
                  tensor)

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> int:
        """Receive the next message with `tag` from whichever rank sends one first; returns that rank (in the
        group). A parameter server takes its workers' gradients in the order they come."""
        self._on_device(tensor)
        source = []
        self._run("recv", _nbytes(tensor), lambda: source.append(dist.recv(tensor, group=self.group, tag=tag)),
                  tensor)
        return dist.get_group_rank(self.group, source[0]) if self.group is not None else source[0]

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]]) -> list[PendingCollective]:
        """Point to point, as one batch: start sending each (tensor, group rank) and receiving into
        each (buffer, group rank); return once every receive has arrived, with the sends still in
        flight (wait on them before touching their tensors). Starting a send together with the next
        receive, rather than send then receive, is what keeps two ranks that exchange both ways from
        each blocking in its send: NCCL runs one pair's sends and receives on one stream."""
        in_flight, arriving = self.post(sends, recvs)
        for receive in arriving:
            receive.wait()
        return in_flight

    def post(self, sends: list[tuple[torch.Tensor, int]],
             recvs: list[tuple[torch.Tensor, int]]) -> tuple[list[PendingCollective], list[PendingCollective]]:
        """exchange's batch, started and not waited for: (the sends, the receives) in flight. Wait on a receive
        before reading its buffer, on a send before touching its tensor. Under NCCL, which coalesces the batch
        into one work, the receives are that work and the sends none."""
        self._on_device(*(t for t, _ in sends + recvs))
        ops = ([dist.P2POp(dist.isend, t, group=self.group, group_peer=dst) for t, dst in sends]
               + [dist.P2POp(dist.irecv, t, group=self.group, group_peer=src) for t, src in recvs])
        if not ops:
            return [], []
        nbytes = sum(_nbytes(t) for t, _ in sends + recvs)
        fp = self._fingerprint("send/recv", tuple(t for t, _ in sends + recvs))
        launched = self.clock.mark()
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self.failure("send/recv", nbytes, e, fp) from e
        if len(works) != len(ops):
            # (On NCCL, wait() only orders the compute stream after the transfers; the host does not block.)
            return [], [PendingCollective(self, "send/recv", nbytes, work, fp=fp, launched=launched)
                        for work in works]
        # Each send keeps its tensor until waited on: the buffer must outlive the transfer.
        return ([PendingCollective(self, "send", _nbytes(t), w, payload=t, fp=fp, launched=launched)
                 for (t, _), w in zip(sends, works)],
                [PendingCollective(self, "recv", _nbytes(t), w, payload=t, fp=fp, launched=launched)
                 for (t, _), w in zip(recvs, works[len(sends):])])

    def barrier(self) -> None:
        if not self.alone:
            self._run("barrier", 0, lambda: dist.barrier(group=self.group))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_SITE_NAMES: dict[str, str] = {}


def call_site(skip: str = __file__) -> str:
    """'sharded_units.py:154': the first frame outside the file `skip` (by default this one: who called the
    collective). A few frames up, one cached basename: cheap enough for every collective."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == skip:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    name = _SITE_NAMES.get(path)
    if name is None:
        name = _SITE_NAMES[path] = os.path.basename(path)
    return f"{name}:{frame.f_lineno}"
