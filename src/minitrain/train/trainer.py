"""One training step: forward, backward, the gradient sync, the update; and the trainer's state in a checkpoint.
(The loop around it, with cadence, signals and rollback, is loop.py; the step's statistics, timed, exchanged and
read back into its record, are step_statistics.py.)

It calls no collective itself: gradient sync and parameter updates belong to the strategy, and the one per-step
statistics exchange to the statistics component. That exchange also carries what the loop passes in (each rank's
stop signal and background-save progress, step_stats.StepRequests), so the ranks agree on both without another
collective.

The model comes from a spec (models/spec.py: how to build it, its plan, where it counts an expert load); the
trainer knows no model family.
"""
from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .. import checkpoint
from ..runtime.comm import CollectiveError
from ..config import RunConfig
from ..data import EvalBatches, load_val, make_loader
from ..utils.prefetch import to_device
from ..models import ModelSpec, spec_for
from ..parallel import Pipeline, cast_parameters, parallelize
from ..parallel.context_parallel.layout import ContextLayout
from ..parallel.core.config import ParallelConfig
from ..runtime.topology import Topology
from .faults import Faults
from .guards import NonFiniteGuard, SpikeGuard
from .late_stats import reads_late
from .offload_files import offload_directory, offload_store
from .optim import flat_adamw_factory, lr_at
from .precision import autocast, compute_dtype, make_loss_scaler, master_dtype, reduce_dtype
from .step_record import StepRecord
from .step_statistics import LaunchedStep, StepStatistics, StepWatch, holds_loss
from .step_stats import Agreed, StepRequests


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


class Trainer:
    """One rank's training state (model, strategy, data position, guards) and its step. close() (or leaving a
    `with Trainer(...)` block) takes the strategy's hooks off the model, so a dropped trainer is freed."""

    def __init__(self, cfg: RunConfig, topo: Topology, spec: ModelSpec | None = None, param_norm_every: int = 1,
                 stop_requested: Callable[[], bool] = lambda: False):
        """spec: the model family to build and its plan (default: the one cfg.model describes, models.spec_for).
        param_norm_every: the records carry the parameter norm every this-many steps and at the last step (0: at the
        last only; step_statistics.py); `minitrain train` passes its progress lines' --train.log_every.
        stop_requested: whether a stop signal has come (a deliberate hold waits for it, faults.py)."""
        if cfg.dist.ep > 1 and topo.ep.world_size == 1:  # the experts' groups and their replicas (collective)
            topo = topo.with_experts(cfg.dist.ep)
        if cfg.dist.cp > 1 and topo.cp.world_size == 1:  # the groups that split sequences, and their readers
            topo = topo.with_context(cfg.dist.cp)
        self.cfg, self.topo = cfg, topo
        self.context = ContextLayout(topo.cp.rank, topo.cp.world_size) if topo.cp.world_size > 1 else None
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
            cfg.train.activation_checkpointing, self._pipeline_builder(), compile=cfg.train.compile,
            cp_style=cfg.dist.cp_style, virtual_stages=cfg.dist.virtual_stages)
        # Data is split over data-parallel replicas only (a tensor- or context-parallel group shares its batch), or
        # under expert parallelism over every rank (topo.data).
        self._corpus_sha256: str | None = None  # computed at the first save (train_state)
        self.loader = make_loader(cfg, topo.data.rank, topo.data.world_size, prefetch=cfg.data.prefetch,
                                  pin_memory=topo.device.type == "cuda")
        self.eval_batches = (EvalBatches(load_val(cfg), cfg.model.seq_len, cfg.train.batch_size, topo.data.rank,
                                         topo.data.world_size, cfg.eval.batches) if cfg.eval.every else None)
        self.step = 0  # training steps completed (a skipped step counts: its data was consumed)
        self.nonfinite = NonFiniteGuard(cfg.train.max_skipped_steps, self.loss_scaler)
        self.tokens_seen = 0
        t = cfg.train
        self.tokens_per_step = t.batch_size * t.grad_accum * topo.data.world_size * cfg.model.seq_len
        self.spikes = SpikeGuard(t.spike_factor, t.spike_window)
        self.faults = Faults(cfg.fault, topo.rank, resumed=False,
                             offload_files=offload_directory(cfg) if cfg.train.offload == "disk" else None,
                             world=topo.world_size, stop_requested=stop_requested)
        self.stats = StepStatistics(topo, self.strategy, self.pipeline, tokens_per_step=self.tokens_per_step,
                                    grad_accum=t.grad_accum, scales_loss=self.loss_scaler is not None,
                                    expert_layers=spec.expert_layers(self.model), param_norm_every=param_norm_every,
                                    last_step=t.steps)
        self.agreed = Agreed()  # what the ranks agreed on at the last step boundary (step_stats.py)
        self.late_stats = reads_late(cfg, topo.device, self.strategy, self.loss_scaler, self.pipeline)
        self._unread: LaunchedStep | None = None  # late statistics: the step launched and not read yet

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
        self.stats.close()
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
        return lambda strategy, chunks: Pipeline(strategy.module, topo.pp, d.schedule, d.microbatches,
                                                 self.cfg.model.d_model, compute_dtype(t), topo.device,
                                                 lambda: autocast(t, topo.device), strategy.no_sync, chunks)

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
        """One step: forward and backward, the gradient sync, the update; then its statistics exchange, issued (on a
        GPU: queued; nothing read back). The watch times the step's phases (step_statistics.py)."""
        measure_sync = self.cfg.ddp.measure_sync if measure_sync is None else measure_sync
        watch = self.stats.begin(measure_sync, before_start=lambda: self.faults.at_step_start(self.step + 1))
        loss_scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        loss_sum = self._forward_backward(loss_scale, watch)
        with watch.sync():  # what of the gradient sync backward did not hide
            self.strategy.finish_grad_sync()
        lr = lr_at(self.step, self.cfg.train) * self.faults.lr_factor(self.step + 1)
        with watch.update():  # clip, update, publish: the global gradient norm, read with the statistics
            grad_norm = self.strategy.step(lr, loss_scale)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return self.stats.issue(watch, requests, step=self.step, lr=lr, loss_scale=loss_scale,
                                tokens_seen=self.tokens_seen, loss_sum=loss_sum, grad_norm=grad_norm)

    def _forward_backward(self, loss_scale: float, watch: StepWatch) -> torch.Tensor:
        """Forward and backward of every micro-batch of the step, the gradient sync launched in the last backward.
        Returns the sum of the micro-batches' losses, on the device (read once, in the statistics exchange: no
        host sync per micro-batch)."""
        cfg, strategy = self.cfg.train, self.strategy
        if not self.model.training:  # train() walks every module: not on every step
            self.model.train()
        # ZeRO-2/3 give their gradient shard back until this step's first reduction takes it again: it is not held
        # through the forward's activations (FSDP2's sharded gradients are freed by zero_grad(set_to_none=True)).
        strategy.zero_grad(release=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        bad_batch = self.faults.loss_factor(self.step + 1)  # NaN at a deliberate nan fault's step, else 1
        for micro in range(cfg.grad_accum):
            last = micro == cfg.grad_accum - 1
            with watch.phase("data"):
                x, y = (self._local(self._to_device(t)) for t in self.loader.next_batch())  # every stage reads it
            if self.pipeline is not None:  # micro-batches through the stages; it syncs in the last backward
                with watch.phase("forward_backward"):
                    loss_sum += self.pipeline.run(x, y, loss_scale / cfg.grad_accum * bad_batch, sync=last)
                continue
            with contextlib.nullcontext() if last else strategy.no_sync():  # sync once per step
                with watch.phase("forward"), autocast(cfg, self.topo.device):  # backward follows its dtypes
                    loss = strategy.module(x, y)
                    loss = loss if bad_batch == 1.0 else loss * bad_batch
                # Mean over this rank's tokens / accumulation; the strategy averages over ranks,
                # so the gradient is the mean over the global token count.
                with watch.phase("backward"):
                    scaled = loss / cfg.grad_accum
                    (scaled if loss_scale == 1.0 else scaled * loss_scale).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    def _read(self, launched: LaunchedStep) -> StepRecord:
        """A launched step's record, from its exchange (the host waits for the device up to there, no further); the
        guard against non-finite steps takes its gradient norm."""
        record, self.agreed = self.stats.read(launched)
        return replace(record, overflow=self.nonfinite.after_step(launched.step, record.skipped))

    def evaluate(self) -> float:
        """Collective: the mean loss over the held-out batches (data.EvalBatches: each data-parallel rank
        its disjoint share, the same examples every time), with the model as it is now. Every rank that
        computes a loss (all, or a pipeline's last stages) adds it in; a tensor-parallel group's ranks
        hold the same value, so the mean over the holders is the mean over the examples."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        self.model.eval()  # the next train_step switches back
        with torch.no_grad():
            for x, y in self.eval_batches:
                x, y = self._local(self._to_device(x)), self._local(self._to_device(y))
                if self.pipeline is not None:
                    loss_sum += self.pipeline.evaluate(x, y)
                else:
                    with autocast(self.cfg.train, self.topo.device):
                        loss_sum += self.strategy.module(x, y).double()
        holds = holds_loss(self.pipeline)
        both = torch.stack([loss_sum * holds / self.eval_batches.batches,
                            torch.tensor(holds, dtype=torch.float64, device=self.topo.device)])
        self.topo.everyone.all_reduce_sum(both)
        total, holders = both.tolist()
        return total / holders

    def _local(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a batch of sequences: under context parallelism its two chunks of each."""
        return batch if self.context is None else self.context.local(batch)

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        """A CPU batch onto the device: on a GPU from pinned memory (the prefetch thread pinned it) without
        blocking the host, so the copy overlaps whatever the GPU is still running."""
        return to_device(batch, self.topo.device)

    def train_state(self) -> dict:
        if self._corpus_sha256 is None and self.topo.is_main:  # the manifest's copy is rank 0's
            self._corpus_sha256 = self.loader.fingerprint()
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
        self.faults.on_resume()  # without a ledger, deliberate faults never fire in a run that loaded a checkpoint
