"""One training step: forward, backward, sync, update, and the step's record; and the
trainer's state in a checkpoint. (The loop around it, with cadence, signals and
rollback, is loop.py.)

It calls no collective itself: gradient sync and parameter updates belong to
the strategy, and the one per-step statistics exchange goes through the comm
layer's `gather_rows`. That exchange also carries what the loop passes in (each
rank's stop signal and background-save progress, step_stats.StepRequests), so
the ranks agree on both without another collective.

The model comes from a spec (models/spec.py: how to build it, and its plan); the
trainer knows no model family.
"""
from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import checkpoint
from ..runtime.comm import CollectiveError, OpStats
from ..config import RunConfig
from ..data import EvalBatches, ShardedLoader, corpus_fingerprint, load_corpus, load_val
from ..utils.prefetch import to_device
from ..models import ModelSpec, spec_for
from ..models.minigpt.moe import MoEMLP
from ..parallel import Pipeline, cast_parameters, parallelize
from ..parallel.core.config import ParallelConfig
from ..parallel.core.strategy import sync_figures
from ..parallel.core.memory_math import MEMORY_KINDS
from ..runtime.topology import Topology
from .faults import Faults
from .guards import NonFiniteGuard, SpikeGuard
from .late_stats import LaunchedStep, reads_late
from .memory import DevicePeak
from .offload import offload_directory, offload_store
from .optim import flat_adamw_factory, lr_at
from .precision import autocast, compute_dtype, make_loss_scaler, master_dtype, reduce_dtype
from .step_stats import PEAK_KINDS, Agreed, RankStats, StepRequests
from .step_timer import StepTimer


def seed_everything(seed: int, rank: int) -> None:
    """torch alike on every rank (identical initial weights); python and numpy per rank, so a run
    is reproducible whole, down to the generator states its checkpoints hold."""
    torch.manual_seed(seed)
    random.seed(f"minitrain/{seed}/rank{rank}")
    np.random.seed([seed, rank])


def parallel_config(cfg: RunConfig) -> ParallelConfig:
    """What the strategies need of the run's settings."""
    t = cfg.train
    return ParallelConfig(zero=t.zero, dp=cfg.ddp.mode, bucket_mb=cfg.ddp.bucket_mb, prefetch=t.prefetch,
                          master_dtype=master_dtype(t), reduce_dtype=reduce_dtype(t), grad_clip=t.grad_clip,
                          offload=t.offload)


@dataclass
class StepRecord:
    """One line of metrics.jsonl. Per-rank lists are indexed by rank."""

    step: int
    loss: float
    grad_norm: float
    param_norm: float
    lr: float
    tokens: int
    tokens_seen: int
    step_time_s: float
    tokens_per_s: float
    comm_time_s: float
    comm_bytes: int
    comm_calls: int
    param_norm_per_rank: list[float]
    memory: dict[str, list[int]]  # bytes at rest: {"params": [rank0, rank1, ...], ...}
    memory_peak: dict[str, list[int]]  # most bytes held during the step: params, grads, optimizer, total, device
    sync: dict  # this rank's gradient sync: buckets, all-reduce calls and times, overlap (see sync_summary)
    skipped: bool = False  # non-finite gradients (or an fp16 overflow): no update this step
    loss_scale: float | None = None  # fp16: the loss scale this step's backward used
    overflow: bool = False  # fp16: skipped because the scaled gradients overflowed (the scale halved)
    # Pipelined runs: schedule, stages, micro-batches, expected_bubble, and per stage the measured bubble and
    # peak in-flight micro-batches (Pipeline.run).
    pipeline: dict | None = None
    # Where this rank's step went (step_timer.py): seconds of data, forward, backward, forward_backward
    # (pipelined steps), comm (exposed), optimizer, other; None for a phase this kind of step has not.
    phases_s: dict | None = None
    # Per rank, the host seconds from the end of the last step's statistics exchange to this one's, less the
    # time it waited in the gradient sync and the update's collectives: a straggler's is the largest.
    busy_s_per_rank: list[float] | None = None
    # Wall-clock seconds since the run (or its resume) started, at the end of this step.
    elapsed_s: float | None = None
    # Unix time at the end of this step: lines from different attempts of one run (a torchrun restart, an
    # elastic resize) line up on it, and a recovery time is read off it.
    time: float | None = None
    # The held-out loss after this step's update and its perplexity exp(val_loss): only on steps that evaluated
    # (eval.every), else None.
    val_loss: float | None = None
    val_ppl: float | None = None
    # A mixture of experts: per MoE layer, the slots each expert received this step over every rank (token x
    # choice pairs), then the slots dropped over capacity; None for a dense model.
    expert_load: list[list[float]] | None = None


class Trainer:
    """One rank's training state (model, strategy, data position, guards) and its step. close() (or leaving a
    `with Trainer(...)` block) takes the strategy's hooks off the model, so a dropped trainer is freed."""

    def __init__(self, cfg: RunConfig, topo: Topology, spec: ModelSpec | None = None):
        """spec: the model family to build and its plan (default: the one cfg.model describes, models.spec_for)."""
        if cfg.dist.ep > 1 and topo.ep.world_size == 1:  # the experts' groups and their replicas (collective)
            topo = topo.with_experts(cfg.dist.ep)
        self.cfg, self.topo = cfg, topo
        spec = spec or spec_for(cfg.model)
        seed_everything(cfg.train.seed, topo.rank)
        # Initialised in --dtype, then held in the compute dtype (16-bit in mixed precision; the
        # strategy's optimizer keeps the master copy in --dtype).
        self.model = spec.build(cfg.model).to(device=topo.device, dtype=getattr(torch, cfg.train.dtype))
        cast_parameters(self.model, compute_dtype(cfg.train))
        self.loss_scaler = make_loss_scaler(cfg.train)
        self.offload = offload_store(cfg, topo.rank)  # where the optimizer's master and state live, if offloaded
        # The same path minitrain.prepare takes, with the model's plan and the CLI's own optimizer.
        self.strategy, self.pipeline = parallelize(
            self.model, topo, parallel_config(cfg), flat_adamw_factory(cfg.train, self.offload), spec.plan,
            cfg.train.activation_checkpointing, self._pipeline_builder(), compile=cfg.train.compile)
        # Data is split over data-parallel replicas only (a tensor-parallel group shares its batch), or under
        # expert parallelism over every rank (topo.data).
        self._corpus_sha256: str | None = None  # computed at the first save (train_state)
        self.loader = ShardedLoader(load_corpus(cfg), cfg.model.seq_len, cfg.train.batch_size,
                                    topo.data.rank, topo.data.world_size, cfg.train.seed,
                                    prefetch=cfg.data.prefetch, pin_memory=topo.device.type == "cuda")
        self.eval_batches = (EvalBatches(load_val(cfg), cfg.model.seq_len, cfg.train.batch_size, topo.data.rank,
                                         topo.data.world_size, cfg.eval.batches) if cfg.eval.every else None)
        self.step = 0  # training steps completed (a skipped step counts: its data was consumed)
        self.nonfinite = NonFiniteGuard(cfg.train.max_skipped_steps, self.loss_scaler)
        self.tokens_seen = 0
        t = cfg.train
        self.tokens_per_step = t.batch_size * t.grad_accum * topo.data.world_size * cfg.model.seq_len
        self.spikes = SpikeGuard(t.spike_factor, t.spike_window)
        self.timer = StepTimer(topo.device)
        self.device_peak = DevicePeak(topo.device)
        self._moe_layers = [m for m in self.model.modules() if isinstance(m, MoEMLP)]  # their load, every step
        self.faults = Faults(cfg.fault, topo.rank, resumed=False,
                             offload_files=offload_directory(cfg) if cfg.train.offload == "disk" else None,
                             world=topo.world_size)
        self.agreed = Agreed()  # what the ranks agreed on at the last step boundary (step_stats.py)
        self._last_exchange_end: float | None = None  # when this rank's last statistics exchange returned
        self._device_busy = 0.0  # on a GPU: the last step's busy seconds, from its events (train_step)
        self.late_stats = reads_late(cfg, topo.device, self.strategy, self.loss_scaler, self.pipeline)
        self._unread: LaunchedStep | None = None  # late statistics: the step launched and not read yet
        # A device clock's collective totals at the last read (booked since: the next read's step's).
        self._comm_at_read = self._comm_totals()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for NaN/Inf gradients so far (fp16 overflows apart)."""
        return self.nonfinite.skipped_steps

    @property
    def overflow_steps(self) -> int:
        """fp16 steps skipped because the scaled gradients overflowed."""
        return self.nonfinite.overflow_steps

    def close(self) -> None:
        """Take the strategy's hooks off the model: no further step, and nothing keeps the trainer alive."""
        self.strategy.close()
        self.loader.close()
        self.device_peak.close()
        if self.offload is not None:
            self.offload.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def _pipeline_builder(self):
        """Builds the executor of a pipelined (or micro-batched) step, or None when the step is one pass."""
        d, t, topo = self.cfg.dist, self.cfg.train, self.topo
        if d.pp == 1 and d.microbatches == 1:
            return None
        return lambda strategy: Pipeline(strategy.module, topo.pp, d.schedule, d.microbatches, self.cfg.model.d_model,
                                         compute_dtype(t), topo.device, lambda: autocast(t, topo.device),
                                         strategy.no_sync)

    def train_step(self, requests: StepRequests = StepRequests(), measure_sync: bool | None = None) -> StepRecord:
        """One step: forward and backward over grad_accum micro-batches, the gradient sync, the update, and the
        statistics exchange that also shares `requests` (what every rank then agrees on is in `self.agreed`);
        returns its record, read at once (the host waits for the device). measure_sync: bracket the step with
        barriers to time its compute and exposed sync (None: the config's --measure-sync); every rank must pass
        the same."""
        if self._unread is not None:
            raise RuntimeError("a step from launch_step is not read yet: call settle() first")
        return self._guarded(lambda: self._read(self._launch(requests, measure_sync)))

    def launch_step(self, requests: StepRequests = StepRequests(),
                    measure_sync: bool | None = None) -> StepRecord | None:
        """train_step as the run loop takes it: with late statistics (`self.late_stats`, --train.late_stats) the
        step's exchange is only issued and read while the next step runs, so the host never waits for the device
        between steps: this returns the record of the step before (None when there is none), and `self.agreed`
        is what the ranks agreed on then; settle() reads this one's. Without, this step's record. The trainer's
        state is this step's either way."""
        def step():
            launched = self._launch(requests, measure_sync)
            if not self.late_stats:
                return self._read(launched)
            earlier, self._unread = self._unread, launched
            return None if earlier is None else self._read(earlier)
        return self._guarded(step)

    def _guarded(self, step):
        """step() (the next step's launch, and maybe reads), a failed collective's error naming the step."""
        number = self.step + 1
        if self.topo.watch is not None:  # hang diagnoses name the step; every N steps, the fingerprint check
            self.topo.watch.at_step(number, self.cfg.dist.fingerprint_every)
        try:
            return step()
        except CollectiveError as e:
            # The comm layer names the op and the rank; the step says when (a peer hung or died).
            raise CollectiveError(f"step {number}: {e}") from e

    def settle(self) -> StepRecord | None:
        """The record of the last step whose statistics are not read yet (late statistics), read now: the host
        waits for the device. None when every step has been read."""
        launched, self._unread = self._unread, None
        return None if launched is None else self._read(launched)

    def _launch(self, requests: StepRequests, measure_sync: bool | None) -> LaunchedStep:
        """The step's work and its statistics exchange, issued (on a GPU: queued; nothing read back)."""
        comm, strategy = self.topo.dp, self.strategy
        measure_sync = self.cfg.ddp.measure_sync if measure_sync is None else measure_sync
        # This rank's busy time runs from the end of the last exchange: a straggler's slowness before the step
        # counts, and the other ranks' wait for it (in the gradient sync) is taken out below.
        since = self._last_exchange_end or time.perf_counter()
        self.faults.at_step_start(self.step + 1)
        on_device = comm.clock.on_device
        # On the host every collective is booked when it ends: the step's are those booked while it ran. A device
        # clock books them once their events are done, so there a step's are those booked since the last read.
        before = None if on_device else self._comm_totals()
        if measure_sync:
            comm.barrier()  # every rank starts the step together
        start = time.perf_counter()
        # On a GPU the step's time is the device's, from where it reaches this mark to the exchange's end: the host
        # runs ahead of it (a step launched while the last one still runs), so its clock would not tell.
        start_mark = None
        if self.topo.device.type == "cuda":
            start_mark = torch.cuda.Event(enable_timing=True)
            start_mark.record()
        timer = self.timer = StepTimer(self.topo.device)
        timer.start()
        strategy.ledger.reset_peak()
        self.device_peak.reset()
        loss_scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        loss_sum = self._forward_backward(loss_scale)
        bracketed = {}
        with timer.phase("comm"):  # what of the gradient sync backward did not hide
            backward_end = time.perf_counter()
            strategy.finish_grad_sync()
            if measure_sync:
                comm.barrier()  # ...and ends when the slowest rank has its synced gradients
                done = time.perf_counter()
                # compute_and_sync: forward + backward + sync, barrier to barrier. sync_exposed: the part
                # after this rank's backward returned, i.e. communication not hidden behind compute.
                bracketed = {"compute_and_sync_s": done - start, "sync_exposed_s": done - backward_end}
            waited = time.perf_counter() - backward_end
        lr = lr_at(self.step, self.cfg.train) * self.faults.lr_factor(self.step + 1)
        norm, update_comm = self._update(lr, loss_scale)
        waited += update_comm
        # This rank's busy seconds: host time since the last exchange less its waits; on a GPU, the device time in
        # its phases but comm of the last step read (its events are read after its exchange).
        busy = self._device_busy if on_device else time.perf_counter() - since - waited
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        rows, copied = self._exchange(loss_sum, norm, busy, requests)
        return LaunchedStep(step=self.step, lr=lr, loss_scale=loss_scale, tokens_seen=self.tokens_seen, start=start,
                            start_mark=start_mark, ended=time.perf_counter(), timer=timer,
                            sync_marks=strategy.take_sync_marks(), bracketed=bracketed, rows=rows, copied=copied,
                            comm=(before, None if on_device else self._comm_totals()))

    def _read(self, launched: LaunchedStep) -> StepRecord:
        """A launched step's record, from its exchange (the host waits for the device up to there, no further)."""
        if launched.copied is not None:
            launched.copied.synchronize()
        rows = [RankStats.unpack(row) for row in launched.rows.tolist()]
        self.agreed = Agreed.of(rows)
        skipped = not math.isfinite(rows[0].grad_norm)  # global: the same on every rank (the kernel un-counted it)
        overflow = self.nonfinite.after_step(launched.step, skipped)
        elapsed = (launched.start_mark.elapsed_time(launched.copied) / 1000 if launched.copied is not None
                   else launched.ended - launched.start)
        phases = self._phases(launched.timer, elapsed)
        before, after = launched.comm
        if after is None:  # a device clock: what was booked since the last read (this step's events are done)
            before, after = self._comm_at_read, self._comm_totals()
            self._comm_at_read = after
        if launched.sync_marks is not None:
            self.strategy.last_sync = sync_figures(launched.sync_marks, self.topo.dp.clock, wait=True)
        return StepRecord(
            step=launched.step,
            loss=sum(r.loss * r.holds_loss for r in rows) / sum(r.holds_loss for r in rows),  # over the holders
            grad_norm=rows[0].grad_norm,
            param_norm=rows[0].param_norm,
            lr=launched.lr,
            tokens=self.tokens_per_step,
            tokens_seen=launched.tokens_seen,
            step_time_s=elapsed,
            tokens_per_s=self.tokens_per_step / elapsed,
            comm_time_s=after.seconds - before.seconds,
            comm_bytes=after.bytes - before.bytes,
            comm_calls=after.calls - before.calls,
            param_norm_per_rank=[r.param_norm for r in rows],
            memory={kind: [int(r.at_rest[i]) for r in rows] for i, kind in enumerate(MEMORY_KINDS)},
            memory_peak={kind: [int(r.peak[i]) for r in rows] for i, kind in enumerate(PEAK_KINDS)},
            sync={**self.strategy.last_sync, **launched.bracketed},
            skipped=skipped,
            loss_scale=launched.loss_scale if self.loss_scaler else None,
            overflow=overflow,
            pipeline=self._pipeline_record([[r.bubble, r.in_flight] for r in rows]),
            phases_s=phases,
            busy_s_per_rank=[r.busy_s for r in rows],
            expert_load=self._expert_load(rows),
        )

    def _expert_load(self, rows: list[RankStats]) -> list[list[float]] | None:
        """Per MoE layer, the slots each expert received over every rank this step, then the slots dropped."""
        if not self._moe_layers:
            return None
        width = self._moe_layers[0].experts + 1
        total = [sum(values) for values in zip(*(r.expert_load for r in rows))]
        return [total[i:i + width] for i in range(0, len(total), width)]

    def _forward_backward(self, loss_scale: float) -> torch.Tensor:
        """Forward and backward of every micro-batch of the step, the gradient sync launched in the last backward.
        Returns the sum of the micro-batches' losses, on the device (read once, in the statistics exchange: no
        host sync per micro-batch)."""
        cfg, strategy, timer = self.cfg.train, self.strategy, self.timer
        if not self.model.training:  # train() walks every module: not on every step
            self.model.train()
        # ZeRO-2/3 give their gradient shard back until this step's first reduction takes it again: it is not held
        # through the forward's activations (FSDP2's sharded gradients are freed by zero_grad(set_to_none=True)).
        strategy.zero_grad(release=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        for micro in range(cfg.grad_accum):
            last = micro == cfg.grad_accum - 1
            with timer.phase("data"):
                x, y = (self._to_device(t) for t in self.loader.next_batch())  # every stage reads it: in step
            if self.pipeline is not None:  # micro-batches through the stages; it syncs in the last backward
                with timer.phase("forward_backward"):
                    loss_sum += self.pipeline.run(x, y, loss_scale / cfg.grad_accum, sync=last)
                continue
            with contextlib.nullcontext() if last else strategy.no_sync():  # sync once per step
                with timer.phase("forward"), autocast(cfg, self.topo.device):  # backward follows its dtypes
                    loss = strategy.module(x, y)
                # Mean over this rank's tokens / accumulation; the strategy averages over ranks,
                # so the gradient is the mean over the global token count.
                with timer.phase("backward"):
                    scaled = loss / cfg.grad_accum
                    (scaled if loss_scale == 1.0 else scaled * loss_scale).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    def _update(self, lr: float, loss_scale: float) -> tuple[torch.Tensor, float]:
        """The optimizer step (clip, update, publish). Returns the global gradient norm as a float64 tensor (on the
        device where the optimizer skips a non-finite step by itself, FlatAdamW's fused kernel: read with the
        step's statistics, not here) and, on the host, the seconds its own collectives took (the norm's
        all-reduce, ZeRO's gathers), which are moved from the optimizer's phase to comm. On a GPU those are read
        after the exchange (_phases)."""
        strategy, groups = self.strategy, self._update_groups()
        for group in groups:
            group.tag = "update"
        with self.timer.phase("optimizer"):
            norm = (strategy.step_on_device(lr, loss_scale) if strategy.steps_on_device else
                    torch.tensor(strategy.step(lr, loss_scale), dtype=torch.float64))
        for group in groups:
            group.tag = None
        if self.topo.dp.clock.on_device:
            return norm, 0.0
        update_comm = sum(group.take_tagged("update") for group in groups)
        self.timer.move(update_comm, "optimizer", "comm")
        return norm, update_comm

    def _exchange(self, loss_sum: torch.Tensor, norm: torch.Tensor, busy: float,
                  requests: StepRequests) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Every rank's RankStats, packed (one gather_rows: the step's one read of device values), issued: the rows
        and, on a GPU, the event after which their copy in pinned host memory is complete (_read waits for it)."""
        held, peak = self.strategy.memory_bytes(), self.strategy.peak_memory_bytes()
        peak["device"] = self.device_peak.bytes()
        measured = self.pipeline.measured if self.pipeline is not None else {}
        mine = RankStats(
            loss=loss_sum / self.cfg.train.grad_accum, holds_loss=self._holds_loss(),
            param_norm=self.strategy.param_norm_tensor(), grad_norm=norm,
            bubble=measured.get("bubble", 0.0), in_flight=measured.get("peak_in_flight", 0),
            at_rest=[held[k] for k in MEMORY_KINDS], peak=[peak[k] for k in PEAK_KINDS],
            stop_signal=requests.stop_signal(), save_written=requests.save_written(),
            save_clock=requests.clock_reading(), busy_s=busy,
            expert_load=[v for layer in self._moe_layers for load, dropped in [layer.take_load()]
                         for v in (*load, dropped)])
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

    def _phases(self, timer: StepTimer, elapsed: float) -> dict:
        """Where this rank's step went (step_timer.py). On a GPU the update's collectives are known only now, after
        the exchange was read, and the busy seconds the next step reports are this step's device time."""
        on_device = self.topo.dp.clock.on_device
        if on_device:
            groups = self._update_groups()
            timer.move(sum(group.take_tagged("update") for group in groups), "optimizer", "comm")
        phases = timer.finish(elapsed)
        if on_device:
            self._device_busy = sum(phases[k] or 0.0 for k in ("data", "forward", "backward", "forward_backward",
                                                                "optimizer"))
        return phases

    def evaluate(self) -> float:
        """Collective: the mean loss over the held-out batches (data.EvalBatches: each data-parallel rank
        its disjoint share, the same examples every time), with the model as it is now. Every rank that
        computes a loss (all, or a pipeline's last stages) adds it in; a tensor-parallel group's ranks
        hold the same value, so the mean over the holders is the mean over the examples."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        self.model.eval()  # the next train_step switches back
        with torch.no_grad():
            for x, y in self.eval_batches:
                x, y = self._to_device(x), self._to_device(y)
                if self.pipeline is not None:
                    loss_sum += self.pipeline.evaluate(x, y)
                else:
                    with autocast(self.cfg.train, self.topo.device):
                        loss_sum += self.strategy.module(x, y).double()
        holds = self._holds_loss()
        both = torch.stack([loss_sum * holds / self.eval_batches.batches,
                            torch.tensor(holds, dtype=torch.float64, device=self.topo.device)])
        self.topo.everyone.all_reduce_sum(both)
        total, holders = both.tolist()
        return total / holders

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        """A CPU batch onto the device: on a GPU from pinned memory (the prefetch thread pinned it) without
        blocking the host, so the copy overlaps whatever the GPU is still running."""
        return to_device(batch, self.topo.device)

    def _comm_totals(self) -> OpStats:
        """Collectives (and point-to-point transfers) so far in the data-, tensor-, pipeline- and expert-parallel
        groups."""
        totals = [group.totals() for group in (*self._update_groups(), self.topo.ep)]
        return OpStats(sum(t.calls for t in totals), sum(t.bytes for t in totals), sum(t.seconds for t in totals))

    def _update_groups(self) -> tuple:
        """The groups a step's update may communicate over: the data-, tensor- and pipeline-parallel groups, and a
        parameter-server worker's pushes and pulls (over the world)."""
        topo = self.topo
        return (topo.dp, topo.tp, topo.pp) + ((topo.servers.world,) if topo.servers is not None else ())

    def _holds_loss(self) -> float:
        """1 where this rank computes the loss (every rank, or a pipeline's last stage), else 0."""
        return float(self.pipeline is None or self.pipeline.last_stage)

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

    def train_state(self) -> dict:
        if self._corpus_sha256 is None and self.topo.is_main:  # the manifest's copy is rank 0's
            self._corpus_sha256 = corpus_fingerprint(self.loader.tokens)
        return {"step": self.step, "optimizer_steps": self.strategy.optimizer.steps_taken,
                "corpus_sha256": self._corpus_sha256,
                "optimizer_scalars": self.strategy.optimizer.scalar_state(),
                "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(),
                "recent_losses": self.spikes.state(),
                "loss_scaler": self.loss_scaler.state() if self.loss_scaler else None}

    def save_checkpoint(self, root: str | Path) -> Path | None:
        """Collective: save now, return the step directory once it is complete. None where the ranks can no longer
        meet for a save (parameter servers that another worker has left: strategy.ending)."""
        self.strategy.settle_for_save()
        if self.strategy.ending:
            return None
        return checkpoint.save(root, self.step, self.strategy.save_topology(self.topo), self.strategy,
                               self.train_state(), self.cfg.to_dict(), after_written=self.faults.after_shard_written)

    def start_async_save(self, root: str | Path) -> checkpoint.AsyncSave:
        """Collective: snapshot now, write in the background; the caller commits it later."""
        self.strategy.settle_for_save()
        return checkpoint.AsyncSave(root, self.step, self.topo, self.strategy, self.train_state(),
                                    self.cfg.to_dict(), after_written=self.faults.after_shard_written)

    def load_checkpoint(self, path: str | Path) -> None:
        """Collective: the state of a checkpoint (a step launched and not read yet is dropped with its record)."""
        state = checkpoint.load(path, self.topo, self.strategy)
        self.strategy.resumed_at(state["step"])
        self._unread = None
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.loader.load_state_dict(state["loader"])
        t = self.cfg.train
        self.spikes = SpikeGuard(t.spike_factor, t.spike_window, state.get("recent_losses"))
        if self.loss_scaler and state.get("loss_scaler"):
            self.loss_scaler.load_state(state["loss_scaler"])
        self.faults.armed = False  # deliberate faults never fire in a run that loaded a checkpoint
