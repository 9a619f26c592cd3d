"""What each rank runs for `minitrain train`: the trainer's steps, and around them the
things a long run needs. Checkpoints on a cadence (written in line or in the background),
an agreed stop on SIGTERM/SIGUSR1 (save, then exit 0), and a rollback to the last
checkpoint when the loss spikes.

Every decision here is taken alike on every rank: the inputs are either the same on all
of them (step, loss, config) or were exchanged at the step boundary (stop signal,
background-save progress), because each decision leads to collectives.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .. import checkpoint
from ..checkpoint import remote
from . import memory
from ..config import ConfigError, RunConfig, profile_range
from .metrics import (
    MetricsWriter,
    best_val_loss,
    clock,
    perplexity,
    phase_report,
    straggler_report,
    sync_report,
)
from ..parallel.expert_parallel.load import dropped_share, imbalance
from ..runtime.signals import StopRequest
from .guards import SpikeError
from .ps_run import train_with_parameter_servers
from .resume import resume_path
from .run_files import write_json, write_run_start
from .step_timer import StepProfiler
from ..runtime.topology import Topology
from .tracking import Tracker
from .step_stats import Agreed, StepRequests
from .step_record import StepRecord
from .trainer import Trainer


def train_worker(topo: Topology, cfg: RunConfig) -> dict:
    """Rank 0 logs and returns the summary."""
    if cfg.ps.servers:
        return train_with_parameter_servers(topo, cfg, lambda worker, config: TrainingRun(worker, config).run())
    return TrainingRun(topo.with_layout(cfg.dist.tp, cfg.dist.pp), cfg).run()


def check_shared_out(out: Path, topo: Topology, store: str) -> list[int]:
    """Collective: OUT must be one directory for every rank (a filesystem the machines share), or checkpoints go to
    a store (--ckpt.dir), where each machine's ranks' files are assembled whole: else no save could be resumed.
    Returns the ranks whose OUT is this rank's."""
    sharing = checkpoint.sharing_ranks(out, topo)
    if not checkpoint.shared_by_all(sharing) and not store:  # every rank decides alike: sharing is everyone's view
        others = sorted(set(range(topo.world_size)) - set(sharing[topo.rank]))
        raise ConfigError(f"--out {out} is not one directory for every rank: rank {topo.rank} does not see rank(s) "
                          f"{others[:8]}{' ...' if len(others) > 8 else ''} write there (each machine its own "
                          "disk); put OUT on a filesystem every machine shares, or give --ckpt.dir "
                          "s3://bucket/prefix, where each checkpoint is assembled whole")
    return sharing[topo.rank]


class TrainingRun:
    def __init__(self, topo: Topology, cfg: RunConfig):
        self.topo, self.cfg = topo, cfg
        # First thing: a signal that arrives while the model builds or a checkpoint loads is kept too.
        self.stop_request = StopRequest().install()
        self.out = Path(cfg.out)
        self.ckpt_root = self.out / "checkpoints"
        # The first rank of those writing into this OUT tidies it (keep_last): rank 0's, and on each machine with a
        # disk of its own, that machine's.
        self.tidies_out = topo.rank == min(check_shared_out(self.out, topo, cfg.ckpt.dir))
        # The parameter norm, a figure no step needs, on the steps that print a progress line (and the last).
        self.trainer = Trainer(cfg, topo, param_norm_every=cfg.train.log_every,
                               stop_requested=lambda: bool(self.stop_request.signum))
        self.topo = topo = self.trainer.topo  # the groups it trains on (under expert parallelism, its own)
        self.start_path = resume_path(cfg)
        if self.start_path is not None:
            self.trainer.load_checkpoint(self.start_path)
            for moved in checkpoint.set_aside_corrupt(self.ckpt_root, self.trainer.step) if self.tidies_out else []:
                self.say(f"set aside {moved}: it does not verify, and the run resumed from an older checkpoint")
        self.writer = (MetricsWriter(self.out / "metrics.jsonl",
                                     resume_step=self.trainer.step if self.start_path else None)
                       if topo.is_main else None)
        self.tracker = None
        if topo.is_main:  # what the run is, on what, with which tokenizer: before its first step
            write_run_start(self.out, cfg, topo, self.start_path)
            self.tracker = Tracker.open(cfg.log, self.out, cfg.to_dict(), resumed=self.start_path is not None)
        self.cadence = SaveCadence(cfg)
        self.saved: list[str] = []
        self.records: list[StepRecord] = []
        self.rollbacks: list[dict] = []
        self.stopped_by: str | None = None
        # A background save (its write), or a checkpoint's upload to the store, not yet committed.
        self.pending: checkpoint.AsyncSave | remote.Upload | None = None
        self.profiler = StepProfiler(profile_range(cfg.train.profile_steps, cfg.train.steps), self.out / "profile",
                                     topo.rank, topo.device)
        # (loss, step): a resumed run's best so far is in the metrics lines before it (rank 0 reads them).
        self.best_val = best_val_loss(self.out / "metrics.jsonl") if self.start_path and topo.is_main else None
        self.started = time.perf_counter()

    def say(self, line: str, err: bool = False) -> None:
        if self.topo.is_main:
            print(line, file=sys.stderr if err else sys.stdout, flush=True)

    def run(self) -> dict:
        t, total = self.trainer, self.cfg.train.steps
        if self.start_path is not None:
            self.say(f"resumed from {self.start_path} at step {t.step}")
        if t.pipeline is not None:
            self.say(pipeline_line(t.pipeline.summary()))
        try:
            while t.step < total:
                self.profiler.before_step(t.step + 1)
                # This rank's news for the step's exchange, which makes every rank agree on it (t.agreed).
                requests = StepRequests(self.stop_request, self.pending, self.cadence.clock)
                record = t.launch_step(requests)  # with late statistics, the step before's (trainer.py)
                self.profiler.after_step(t.step)
                if record is not None and self._took(record):
                    continue
                stop_at = t.step == self.cfg.train.stop_at
                due = self.cadence.due(t.step, t.agreed)
                if due or stop_at or t.agreed.stop_signal or self._evaluates(t.step) or t.step == total:
                    # What acts on the state (a save, an evaluation, a stop) waits for this step's statistics.
                    record = t.settle()
                    if record is not None and self._took(record):
                        continue
                left = t.strategy.ending  # parameter servers that another worker has left: nothing more to pull
                stopping = bool(t.agreed.stop_signal) or stop_at or left
                # Under bounded staleness the workers stop on a signal each at its own step: no one checkpoint
                # holds them all (--stop-at stops every one at the same step, and every one saves at the last).
                unsaved = stopping and not stop_at and self.cfg.ps.staleness > 0 and t.step != total
                if (due or stopping) and not unsaved:
                    unsaved = not self._save(background=self.cfg.ckpt.async_save and not stopping)
                if stopping:
                    self._say_stopped(stop_at, left, unsaved)
                    break
            self._commit_pending()  # the run is done only when its last checkpoint is durable
            summary = self._summary()
            if self.topo.is_main:
                write_json(self.out / "summary.json", summary)
            return summary
        finally:
            self.profiler.stop()
            self.stop_request.uninstall()
            if self.writer:
                self.writer.close()
            if self.tracker:  # what ran, on what, and how it went: the run's files as the trackers' artifacts
                self.tracker.close([self.out / name for name in ("config.json", "env.json", "metrics.jsonl",
                                                                 "summary.json")])
            t.close()  # its hooks off the model: nothing keeps the finished trainer alive

    def _say_stopped(self, stop_at: bool, left: bool, unsaved: bool) -> None:
        t = self.trainer
        if stop_at or t.agreed.stop_signal:
            self.stopped_by = "--stop-at" if stop_at else StopRequest.name(t.agreed.stop_signal)
            cause = "" if stop_at else f" received by rank {list(t.agreed.stop_ranks)}"
        else:
            self.stopped_by, cause = "another worker left", " (the parameter servers take no more updates)"
        if unsaved:
            self.say(f"{self.stopped_by}{cause}: stopped after step {t.step}, no checkpoint (the workers of a run "
                     "with --ps.staleness > 0 stop at different steps, or one has left)")
        else:
            how = "--resume auto" + (" --ps.staleness 0 (resuming needs K = 0 for now)" if self.cfg.ps.staleness
                                     else "")
            self.say(f"{self.stopped_by}{cause}: stopped after step {t.step}, checkpoint {self.saved[-1]}; continue "
                     f"with {how}")

    def _took(self, record: StepRecord) -> bool:
        """Log a step's record and act on it: its evaluation, background work every rank has finished (a save's
        write or its upload), a loss spike. True when the spike rolled the run back."""
        record = self._evaluated(record)
        self.records.append(record)
        self._log(record)
        if self.pending is not None and self.trainer.agreed.save_written:
            self._commit_pending(all_of_it=False)
        return self._rolled_back(record)

    def _evaluates(self, step: int) -> bool:
        every = self.cfg.eval.every
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    def _evaluated(self, r: StepRecord) -> StepRecord:
        """The step's record with the time so far and, on an evaluation step (every eval.every steps and the
        last), the held-out loss (collective: every rank evaluates alike; the trainer is at that step, since
        the loop reads an evaluation step's statistics before the next step)."""
        val = {}
        if self._evaluates(r.step):
            loss = self.trainer.evaluate()
            val = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}  # exp overflows past ~709
            if self.best_val is None or loss < self.best_val[0]:
                self.best_val = (loss, r.step)
        return replace(r, elapsed_s=time.perf_counter() - self.started, time=time.time(), **val)

    def _log(self, r: StepRecord) -> None:
        if self.writer:
            line = asdict(r)
            self.writer.write(line)
            self.tracker.log_record(line)
        every, total = self.cfg.train.log_every, self.cfg.train.steps
        if every and (r.step % every == 0 or r.step == total):
            self.say(progress_line(r, total, self._eta(r)))

    def _eta(self, r: StepRecord) -> float | None:
        """Seconds still to go at this run's mean pace so far (after its first step, which pays for warm-up)."""
        done = len(self.records) - 1
        if done < 1:
            return None
        return (r.elapsed_s - self.records[0].elapsed_s) / done * (self.cfg.train.steps - r.step)

    # --- checkpoints ----------------------------------------------------------------------
    def _save(self, background: bool) -> bool:
        """Save (or start a background save); False when no save could be made (another worker has left)."""
        self._commit_pending()
        if background:
            self.pending = self.trainer.start_async_save(self.ckpt_root)
            return True
        step_dir = self.trainer.save_checkpoint(self.ckpt_root)
        if step_dir is None:
            self.say(f"no checkpoint at step {self.trainer.step}: another worker has left the run")
            return False
        self._saved(step_dir)
        return True

    def _commit_pending(self, all_of_it: bool = True) -> None:
        """Collective: wait for this rank's background work and complete it: a checkpoint's write (it then goes up
        to the store, in the background too) or its upload (committed in the store). all_of_it: until none is left
        (else the one every rank has finished: the steps' exchange agreed)."""
        while self.pending is not None:
            pending, self.pending = self.pending, None
            if isinstance(pending, remote.Upload):
                self._stored(pending.commit())
            else:
                self._saved(pending.commit(), background=True)
            if not all_of_it:
                return

    def _saved(self, step_dir: Path, background: bool = False) -> None:
        """A checkpoint complete in OUT/checkpoints: up to the store with --ckpt.dir (collective; with a background
        save, in the background, committed there once every rank's share is up)."""
        self.cadence.saved()
        if self.cfg.ckpt.keep_last and self.tidies_out:
            checkpoint.prune(self.ckpt_root, self.cfg.ckpt.keep_last)
        if not self.cfg.ckpt.dir:
            self._stored(step_dir)
            return
        upload = remote.Upload(step_dir, self.cfg.ckpt.dir, self.topo, self.cfg.ckpt.keep_last, background)
        if background:
            self.pending = upload
        else:
            self._stored(upload.commit())

    def _stored(self, step_dir: Path) -> None:
        """A checkpoint saved for good: where OUT is not shared, whole in the store only (the machines' shares go)."""
        self.saved.append(str(step_dir) if step_dir.is_dir() else f"{self.cfg.ckpt.dir.rstrip('/')}/{step_dir.name}")

    # --- loss spikes -----------------------------------------------------------------------
    def _rolled_back(self, r: StepRecord) -> bool:
        """On a loss spike, go back to the newest checkpoint saved before the update that
        produced the spiking parameters, and replay from there (same data, same random streams).
        A spike that comes back after rolling back to the same checkpoint is reproducible:
        SpikeError. Without such a checkpoint the spike is reported and training goes on."""
        mean = self.trainer.spikes.check(r.loss)
        if mean is None:
            return False
        self._commit_pending()
        what = f"loss spike at step {r.step}: loss {r.loss:.4f} > {self.cfg.train.spike_factor:g} x running mean {mean:.4f}"
        # The loss of step s comes from the parameters after update s-1: a checkpoint of step s-1
        # already holds them, so the newest usable one is at step s-2 or earlier.
        chosen = self._rollback_target(before=r.step - 1)
        if chosen is None:
            self.say(f"minitrain train: warning: {what}; no checkpoint before step {r.step - 1} to roll back to "
                     "(set --ckpt-every-steps), continuing", err=True)
            return False
        path, stored = chosen
        target = checkpoint.step_of(path)
        if any(rb["to_step"] == target for rb in self.rollbacks):
            raise SpikeError(f"{what}, again after rolling back to step {target}: the spike is reproducible "
                             "(the replay sees the same data); lower --lr, raise --train.spike_factor, or check the data")
        if stored:  # collective: onto every machine's disk (where OUT is not shared, none holds it whole)
            path = remote.fetch_each(self.cfg.ckpt.dir, target, self.ckpt_root, self.topo)
        self.trainer.load_checkpoint(path)
        event = {"step": target, "event": "rollback", "spike_step": r.step, "loss": r.loss, "running_mean": mean,
                 "to_step": target}
        self.rollbacks.append(event)
        if self.writer:
            self.writer.rewind(target)  # the steps after the checkpoint will be logged again as they are redone
            self.writer.write(event)
        self.say(f"{what}; rolled back to {path} and continuing")
        return True

    def _rollback_target(self, before: int) -> tuple[Path, bool] | None:
        """Rank 0 picks the newest checkpoint at a step < `before` that verifies in OUT/checkpoints or is committed in
        the store (where OUT is not shared, machines keep no whole copy); every rank gets (its directory in
        OUT/checkpoints, whether to fetch it from the store)."""
        choice = torch.tensor([-1.0, 0.0], device=self.topo.everyone.device)
        if self.topo.is_main:
            local = {checkpoint.step_of(d): d for d in checkpoint.complete_steps(self.ckpt_root)}
            stored = set()
            if self.cfg.ckpt.dir:
                try:
                    stored = set(remote.committed_steps(self.cfg.ckpt.dir))
                except Exception as e:  # noqa: BLE001 - the other ranks wait in the broadcast below: choose locally
                    self.say(f"minitrain train: warning: cannot list {self.cfg.ckpt.dir} to roll back: {e}", err=True)
            for step in sorted(s for s in set(local) | stored if s < before)[::-1]:
                try:
                    if step in local:
                        checkpoint.verify(local[step])
                    choice.copy_(torch.tensor([step, float(step in stored)]))
                    break
                except checkpoint.CheckpointError as e:
                    if step in stored:  # the store's copy replaces the damaged one
                        choice.copy_(torch.tensor([step, 1.0]))
                        break
                    self.say(f"minitrain train: warning: not rolling back to {local[step].name}: {e}", err=True)
        self.topo.everyone.broadcast(choice, src=0)  # every rank, in every group, rolls back alike
        step, stored = choice.tolist()
        return None if step < 0 else (self.ckpt_root / checkpoint.step_dir_name(int(step)), bool(stored))

    def _summary(self) -> dict:
        t, records, summary = self.trainer, self.records, {}
        if self.cfg.train.memory_profile and records:
            # Collective: each rank's own P and formula (tensor and pipeline parallel ranks hold different slices).
            expectations = self.topo.everyone.gather_rows(torch.tensor(memory.per_rank_expectation(t.strategy),
                                                                       dtype=torch.float64))
        if self.cfg.train.memory_profile and records and self.topo.is_main:
            report = memory.profile(t.strategy, records, self.topo.device, expectations)
            memory.write(report, self.out / "memory.json")
            print(memory.render(report), flush=True)
            summary["memory"] = str(self.out / "memory.json")
        last = records[-1] if records else None
        return {**summary, "steps": t.step, "final_loss": None if last is None else last.loss,
                "best_val": None if self.best_val is None else {"loss": self.best_val[0], "step": self.best_val[1]},
                "elapsed_s": time.perf_counter() - self.started,
                "sync": sync_report([r.sync for r in records], warmup=min(5, len(records) // 5)),
                "profile": None if self.profiler.steps is None else str(self.out / "profile"),
                "phases": phase_report([r.phases_s for r in records], warmup=min(5, len(records) // 5)),
                "stragglers": straggler_report([r.busy_s_per_rank for r in records], min(5, len(records) // 5),
                                               self.cfg.train.straggler_factor),
                "resumed_from": None if self.start_path is None else str(self.start_path),
                "checkpoints": self.saved, "metrics": str(self.out / "metrics.jsonl"),
                "params": t.strategy.flat.numel, "world_size": self.topo.world_size,
                "skipped_steps": t.skipped_steps, "overflow_steps": t.overflow_steps,
                "loss_scale": t.loss_scaler.scale if t.loss_scaler else None,
                "rollbacks": self.rollbacks, "stopped_by": self.stopped_by,
                "pipeline": pipeline_report([r.pipeline for r in records])}


class SaveCadence:
    """When to checkpoint: every K steps, every M minutes, and after the last step (unless ckpt.final_save
    is off and neither cadence is set). The clock is rank 0's, read into each step's statistics exchange
    (StepRequests.save_clock), so every rank agrees (a save is collective) and the step needs no collective or
    device read of its own: with late statistics the save comes a step after the clock ran out, as a stop signal's
    does."""

    def __init__(self, cfg: RunConfig):
        self.every, self.minutes, self.total = cfg.ckpt.every_steps, cfg.ckpt.every_minutes, cfg.train.steps
        self.final = cfg.ckpt.final_save or bool(self.every or self.minutes)
        self.last = time.monotonic()
        self.saves = 0  # made so far: the same on every rank, since every save is made by all of them

    def clock(self) -> int:
        """This rank's reading for the exchange: the saves made so far if the minutes since the last one are up,
        else -1."""
        return self.saves if self.minutes and time.monotonic() - self.last >= 60 * self.minutes else -1

    def due(self, step: int, agreed: Agreed) -> bool:
        if step == self.total:
            return self.final
        if self.every and step % self.every == 0:
            return True
        # A reading taken before the last save (one the ranks agreed on before it, still the latest when no
        # exchange was read since) counts no more.
        return agreed.save_clock == self.saves

    def saved(self) -> None:
        self.last = time.monotonic()
        self.saves += 1


def pipeline_line(p: dict) -> str:
    """What a pipelined run is about to do, and the bubble it cannot avoid."""
    chunks = f" x {p['virtual_stages']} chunks" if p.get("virtual_stages", 1) > 1 else ""
    line = (f"pipeline: {p['stages']} stage(s){chunks}, {p['microbatches']} micro-batches per batch, {p['schedule']}; "
            f"bubble {p['expected_bubble']:.0%} at best")
    if p["microbatches"] < p["stages"]:
        line += f" (fewer micro-batches than stages: --microbatches {p['stages']} or more idles less)"
    return line


def expert_load_text(layers: list[list[float]]) -> str:
    """The busiest expert's load against the mean, at the worst layer (1.00 is perfectly balanced), and the share
    of slots dropped over capacity."""
    loads = [layer[:-1] for layer in layers]
    return (f"experts max/mean {imbalance(loads):.2f} dropped "
            f"{dropped_share(loads, [layer[-1] for layer in layers]):.1%}")


def progress_line(r: StepRecord, total: int, eta_s: float | None = None) -> str:
    width = len(str(total))
    scale = "" if r.loss_scale is None else f"  scale {r.loss_scale:g}"
    if r.overflow:
        skipped = "  SKIPPED (fp16 overflow: loss scale halved, parameters unchanged)"
    else:
        skipped = "  SKIPPED (NaN/Inf gradients, parameters unchanged)" if r.skipped else ""
    bubble = "" if r.pipeline is None else f"  bubble {max(r.pipeline['bubble']):.0%}"
    bubble += "" if r.expert_load is None else f"  {expert_load_text(r.expert_load)} router loss {r.router_loss:.4g}"
    val = "" if r.val_loss is None else f"  val {r.val_loss:.4f} (ppl {perplexity(r.val_loss)})"
    elapsed = "" if r.elapsed_s is None else f"  {clock(r.elapsed_s)}"
    eta = "" if eta_s is None else f" eta {clock(eta_s)}"
    return (f"step {r.step:>{width}}/{total}  loss {r.loss:.4f}{val}  grad_norm {r.grad_norm:.3f}  "
            f"lr {r.lr:.2e}  {r.tokens_per_s:,.0f} tok/s  comm {1000 * r.comm_time_s:.1f} ms{bubble}{scale}{skipped}"
            f"{elapsed}{eta}")


def pipeline_report(records: list[dict | None]) -> dict | None:
    """Per stage, the median measured bubble over the steps (the first, which pays for warm-up, left out)
    beside the formula's."""
    records = [r for r in records if r is not None]
    if not records:
        return None
    steady = records[1:] or records
    bubbles = [statistics.median(r["bubble"][s] for r in steady) for s in range(records[0]["stages"])]
    return {**{k: records[0][k] for k in ("schedule", "stages", "microbatches", "expected_bubble")},
            "bubble": bubbles, "peak_in_flight": records[-1]["peak_in_flight"]}
