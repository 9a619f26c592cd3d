"""A training step's statistics, as a component of their own: the trainer's step (trainer.py) opens a watch on the
step, does its work inside the watch's phases, and hands over its figures; this module times the phases
(step_timer.py), books the step's collectives, measures its memory peaks, issues the step's one statistics
exchange and reads it back into the step's record (step_record.py).

The exchange is one gather_rows of every rank's RankStats (step_stats.py), the step's one read of device values
(tests/parallel/test_step_collectives.py pins it); it also carries what the run loop asks every rank to agree on
(StepRequests). With late statistics (late_stats.py) the trainer reads it while the next step runs.

Not every figure is computed at every step: the parameter norm, a pass over every parameter (and an all-reduce under
tensor or pipeline parallelism) that nothing in the step needs, on the steps `param_norm_every` names. The loss and
the gradient norm, which the guards need, are every step's.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from ..models.spec import CountsExpertLoad
from ..parallel.core.memory_math import MEMORY_KINDS
from ..parallel.core.sync_stats import sync_figures
from ..runtime.comm import OpStats
from ..runtime.topology import Topology
from .memory import DevicePeak
from .step_record import StepRecord
from .step_stats import PEAK_KINDS, Agreed, RankStats, StepRequests
from .step_timer import StepTimer


def holds_loss(pipeline) -> float:
    """1 where this rank computes the loss (every rank, or a pipeline's last stage), else 0."""
    return float(pipeline is None or pipeline.last_stage)


def update_groups(topo: Topology) -> tuple:
    """The groups a step's update may communicate over: the data-, tensor- and pipeline-parallel groups, and a
    parameter-server worker's pushes and pulls (over the world)."""
    return (topo.dp, topo.tp, topo.pp) + ((topo.servers.world,) if topo.servers is not None else ())


def comm_totals(topo: Topology) -> OpStats:
    """Collectives (and point-to-point transfers) so far in the data-, tensor-, pipeline- and expert-parallel
    groups."""
    totals = [group.totals() for group in (*update_groups(topo), topo.ep)]
    return OpStats(sum(t.calls for t in totals), sum(t.bytes for t in totals), sum(t.seconds for t in totals))


class StepWatch:
    """One step's marks, from StepStatistics.begin to its exchange: the step's phases are timed inside it."""

    def __init__(self, topo: Topology, since: float, measure_sync: bool):
        self.topo, self.measure_sync = topo, measure_sync
        self.since = since  # this rank's busy time counts from here (StepStatistics.begin)
        self.waited = 0.0  # host seconds of it spent waiting in the gradient sync and the update's collectives
        self.bracketed: dict = {}  # --measure-sync's figures
        # On the host every collective is booked when it ends: the step's are those booked while it ran. A device
        # clock books them once their events are done, so there a step's are those booked since the last read.
        self.comm_before = None if topo.dp.clock.on_device else comm_totals(topo)
        if measure_sync:
            topo.dp.barrier()  # every rank starts the step together
        self.start = time.perf_counter()
        # On a GPU the step's time is the device's, from where it reaches this mark to the exchange's end: the host
        # runs ahead of it (a step launched while the last one still runs), so its clock would not tell.
        self.start_mark = None
        if topo.device.type == "cuda":
            self.start_mark = torch.cuda.Event(enable_timing=True)
            self.start_mark.record()
        self.timer = StepTimer(topo.device)
        self.timer.start()

    def phase(self, name: str):
        """Time the block as the step's phase `name` (step_timer.PHASES)."""
        return self.timer.phase(name)

    @contextlib.contextmanager
    def sync(self):
        """Time the block, the wait for what of the gradient sync backward did not hide, as comm. With
        --measure-sync the block ends at a barrier: when the slowest rank has its synced gradients."""
        with self.timer.phase("comm"):
            backward_end = time.perf_counter()
            yield
            if self.measure_sync:
                self.topo.dp.barrier()
                done = time.perf_counter()
                # compute_and_sync: forward + backward + sync, barrier to barrier. sync_exposed: the part after this
                # rank's backward returned, i.e. communication not hidden behind compute.
                self.bracketed = {"compute_and_sync_s": done - self.start, "sync_exposed_s": done - backward_end}
            self.waited += time.perf_counter() - backward_end

    @contextlib.contextmanager
    def update(self):
        """Time the block, the optimizer step, as optimizer, less its own collectives (the norm's all-reduce, ZeRO's
        gathers), moved to comm. On a GPU those are known only once the exchange was read (StepStatistics.read)."""
        groups = update_groups(self.topo)
        for group in groups:
            group.tag = "update"
        try:
            with self.timer.phase("optimizer"):
                yield
        finally:
            for group in groups:
                group.tag = None
        if not self.topo.dp.clock.on_device:
            update_comm = sum(group.take_tagged("update") for group in groups)
            self.timer.move(update_comm, "optimizer", "comm")
            self.waited += update_comm


@dataclass
class LaunchedStep:
    """A step whose work and statistics exchange are issued and whose statistics are not read yet
    (StepStatistics.read): what its record needs from the moment it was launched."""

    step: int
    lr: float
    loss_scale: float
    tokens_seen: int
    watch: StepWatch  # its start, phases and --measure-sync's figures
    param_norm: bool  # whether its exchange carries the parameter norm (the schedule's: StepStatistics)
    ended: float  # host clock when its launch returned (on the CPU, when it was done)
    sync_marks: tuple | None  # its gradient sync's marks (FlatStrategy.sync_at)
    rows: torch.Tensor  # every rank's packed RankStats, on the host (once `copied` has fired)
    copied: torch.cuda.Event | None  # on a GPU: fires when `rows` is complete (and ends the step's time)
    comm_after: OpStats | None  # collective totals after it (None: a device clock's, taken at the read)


class StepStatistics:
    """One rank's statistics of its training steps (see the module docstring). close() releases what it holds open.

    param_norm_every: the parameter norm is computed on every this-many-th step and on step `last_step` (0: on the
    last only); on the other steps the record's param_norm and param_norm_per_rank are None. Decided by the step's
    number alone, so every rank computes it (a collective under tensor or pipeline parallelism) at the same steps."""

    def __init__(self, topo: Topology, strategy, pipeline, *, tokens_per_step: int, grad_accum: int, scales_loss: bool,
                 expert_layers: list[CountsExpertLoad], param_norm_every: int = 1, last_step: int = 0):
        self.topo, self.strategy, self.pipeline = topo, strategy, pipeline
        self.tokens_per_step, self.grad_accum, self.scales_loss = tokens_per_step, grad_accum, scales_loss
        self.expert_layers = expert_layers
        self.param_norm_every, self.last_step = param_norm_every, last_step
        self.device_peak = DevicePeak(topo.device)
        self._last_exchange_end: float | None = None  # when this rank's last statistics exchange returned
        self._device_busy = 0.0  # on a GPU: the last step read's busy seconds, from its events (read)
        # A device clock's collective totals at the last read (booked since: the next read's step's).
        self._comm_at_read = comm_totals(topo)

    def close(self) -> None:
        self.device_peak.close()

    def computes_param_norm(self, step: int) -> bool:
        every = self.param_norm_every
        return step == self.last_step or (every > 0 and step % every == 0)

    def begin(self, measure_sync: bool, before_start=None) -> StepWatch:
        """The next step's watch, its clocks started. before_start(): run after this rank's busy time begins and
        before the step's own time does (a deliberate straggler's sleep, faults.py: busy, but not the step's).
        measure_sync: bracket the step with barriers (every rank must pass the same)."""
        # This rank's busy time runs from the end of the last exchange: a straggler's slowness before the step
        # counts, and the other ranks' wait for it (in the gradient sync) is taken out (StepWatch.waited).
        since = self._last_exchange_end or time.perf_counter()
        if before_start is not None:
            before_start()
        watch = StepWatch(self.topo, since, measure_sync)
        self.strategy.ledger.reset_peak()
        self.device_peak.reset()
        return watch

    def issue(self, watch: StepWatch, requests: StepRequests, *, step: int, lr: float, loss_scale: float,
              tokens_seen: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> LaunchedStep:
        """The step's exchange, issued (on a GPU: queued; nothing read back). loss_sum: the sum of its micro-batches'
        losses; grad_norm: the global gradient norm (float64 tensors, maybe on the device)."""
        # This rank's busy seconds: host time since the last exchange less its waits; on a GPU, the device time in
        # its phases but comm of the last step read (its events are read after its exchange).
        on_device = self.topo.dp.clock.on_device
        busy = self._device_busy if on_device else time.perf_counter() - watch.since - watch.waited
        param_norm = self.computes_param_norm(step)
        rows, copied = self._exchange(loss_sum, grad_norm, param_norm, busy, requests)
        return LaunchedStep(step=step, lr=lr, loss_scale=loss_scale, tokens_seen=tokens_seen, watch=watch,
                            param_norm=param_norm, ended=time.perf_counter(),
                            sync_marks=self.strategy.take_sync_marks(), rows=rows, copied=copied,
                            comm_after=None if on_device else comm_totals(self.topo))

    def _exchange(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor, param_norm: bool, busy: float,
                  requests: StepRequests) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Every rank's RankStats, packed (one gather_rows: the step's one read of device values), issued: the rows
        and, on a GPU, the event after which their copy in pinned host memory is complete (read waits for it)."""
        held, peak = self.strategy.memory_bytes(), self.strategy.peak_memory_bytes()
        peak["device"] = self.device_peak.bytes()
        measured = self.pipeline.measured if self.pipeline is not None else {}
        mine = RankStats(
            loss=loss_sum / self.grad_accum, holds_loss=holds_loss(self.pipeline),
            param_norm=self.strategy.param_norm_tensor() if param_norm else math.nan, grad_norm=grad_norm,
            bubble=measured.get("bubble", 0.0), in_flight=measured.get("peak_in_flight", 0),
            at_rest=[held[k] for k in MEMORY_KINDS], peak=[peak[k] for k in PEAK_KINDS],
            stop_signal=requests.stop_signal(), save_written=requests.save_written(),
            save_clock=requests.clock_reading(), busy_s=busy, **self._take_expert_load())
        rows = self.topo.step_peers.gather_rows_on_device(mine.pack(self.topo.device))
        copied = None
        if rows.device.type == "cuda":
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            rows, copied = host, torch.cuda.Event(enable_timing=True)
            copied.record()
        else:
            rows = rows.cpu()
        self._last_exchange_end = time.perf_counter()
        return rows, copied

    def read(self, launched: LaunchedStep) -> tuple[StepRecord, Agreed]:
        """A launched step's record (its `overflow` left to the caller's guard) and what the ranks agreed on, from its
        exchange (the host waits for the device up to there, no further)."""
        if launched.copied is not None:
            launched.copied.synchronize()
        rows = [RankStats.unpack(row) for row in launched.rows.tolist()]
        watch = launched.watch
        elapsed = (watch.start_mark.elapsed_time(launched.copied) / 1000 if launched.copied is not None
                   else launched.ended - watch.start)
        before, after = watch.comm_before, launched.comm_after
        if after is None:  # a device clock: what was booked since the last read (this step's events are done)
            before, after = self._comm_at_read, comm_totals(self.topo)
            self._comm_at_read = after
        if launched.sync_marks is not None:
            self.strategy.last_sync = sync_figures(launched.sync_marks, self.topo.dp.clock, wait=True)
        param_norms = [r.param_norm for r in rows] if launched.param_norm else None
        record = StepRecord(
            step=launched.step,
            loss=sum(r.loss * r.holds_loss for r in rows) / sum(r.holds_loss for r in rows),  # over the holders
            grad_norm=rows[0].grad_norm,
            param_norm=None if param_norms is None else param_norms[0],
            lr=launched.lr,
            tokens=self.tokens_per_step,
            tokens_seen=launched.tokens_seen,
            step_time_s=elapsed,
            tokens_per_s=self.tokens_per_step / elapsed,
            comm_time_s=after.seconds - before.seconds,
            comm_bytes=after.bytes - before.bytes,
            comm_calls=after.calls - before.calls,
            param_norm_per_rank=param_norms,
            memory={kind: [int(r.at_rest[i]) for r in rows] for i, kind in enumerate(MEMORY_KINDS)},
            memory_peak={kind: [int(r.peak[i]) for r in rows] for i, kind in enumerate(PEAK_KINDS)},
            sync={**self.strategy.last_sync, **watch.bracketed},
            skipped=not math.isfinite(rows[0].grad_norm),  # global: the same on every rank (the kernel un-counted it)
            loss_scale=launched.loss_scale if self.scales_loss else None,
            pipeline=self._pipeline_record([[r.bubble, r.in_flight] for r in rows]),
            phases_s=self._phases(watch.timer, elapsed),
            busy_s_per_rank=[r.busy_s for r in rows],
            expert_load=self._expert_load(rows),
            router_loss=sum(r.router_loss for r in rows) / len(rows) if self.expert_layers else None,
        )
        return record, Agreed.of(rows)

    def _phases(self, timer: StepTimer, elapsed: float) -> dict:
        """Where this rank's step went (step_timer.py). On a GPU the update's collectives are known only now, after
        the exchange was read, and the busy seconds the next step reports are this step's device time."""
        on_device = self.topo.dp.clock.on_device
        if on_device:
            timer.move(sum(group.take_tagged("update") for group in update_groups(self.topo)), "optimizer", "comm")
        phases = timer.finish(elapsed)
        if on_device:
            self._device_busy = sum(phases[k] or 0.0 for k in ("data", "forward", "backward", "forward_backward",
                                                                "optimizer"))
        return phases

    def _take_expert_load(self) -> dict:
        """This rank's RankStats fields of its MoE layers' counts since the last step (the counts start over)."""
        counted = [layer.take_load() for layer in self.expert_layers]
        return {"router_loss": sum((c.mean_router_loss() for c in counted), 0.0),
                "expert_load": [v for c in counted for v in (*c.load, c.dropped)]}

    def _expert_load(self, rows: list[RankStats]) -> list[list[float]] | None:
        """Per expert layer, the slots each expert received over every rank this step, then the slots dropped."""
        if not self.expert_layers:
            return None
        total = [sum(values) for values in zip(*(r.expert_load for r in rows))]
        layers, at = [], 0
        for layer in self.expert_layers:
            layers.append(total[at:at + layer.experts + 1])
            at += layer.experts + 1
        return layers

    def _pipeline_record(self, measured: list[list[float]]) -> dict | None:
        """The step's pipeline figures per stage from every rank's [bubble, in flight] (a stage's ranks are
        consecutive, pp being outermost): its bubble (the mean over its ranks) and the most micro-batches
        any of them held at once."""
        if self.pipeline is None:
            return None
        per_stage = len(measured) // self.pipeline.stages
        stages = [measured[i:i + per_stage] for i in range(0, len(measured), per_stage)]
        return {**self.pipeline.summary(), "bubble": [sum(r[0] for r in st) / len(st) for st in stages],
                "peak_in_flight": [int(max(r[1] for r in st)) for st in stages]}
