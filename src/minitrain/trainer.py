"""The training loop: forward, backward, step, log, checkpoint.

It calls no collective itself: gradient sync and parameter updates belong to
the strategy, and the one per-step statistics exchange goes through the comm
layer's `gather_rows`.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import checkpoint, memory
from .comm import CollectiveError
from .config import ConfigError, RunConfig
from .data import ShardedLoader, load_corpus, num_examples
from .memory import device_peak_bytes, reset_device_peak
from .metrics import MetricsWriter, sync_report
from .model import MiniGPT
from .optim import lr_at
from .parallel import make_strategy
from .parallel.flat import MEMORY_KINDS
from .topology import Topology

PEAK_KINDS = (*MEMORY_KINDS, "total", "device")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with NaN/Inf gradients."""


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
    skipped: bool = False  # non-finite gradients: no update this step


class Trainer:
    def __init__(self, cfg: RunConfig, topo: Topology):
        self.cfg, self.topo = cfg, topo
        dtype = getattr(torch, cfg.train.dtype)
        torch.manual_seed(cfg.train.seed)
        self.model = MiniGPT(cfg.model).to(device=topo.device, dtype=dtype)
        self.strategy = make_strategy(self.model, topo.dp, cfg)
        self.loader = ShardedLoader(load_corpus(cfg), cfg.model.seq_len, cfg.train.batch_size,
                                    topo.rank, topo.world_size, cfg.train.seed)
        self.step = 0  # training steps completed (a skipped step counts: its data was consumed)
        self.skipped_steps = self.skipped_in_a_row = 0
        self.tokens_seen = 0
        t = cfg.train
        self.tokens_per_step = t.batch_size * t.grad_accum * topo.world_size * cfg.model.seq_len

    def train_step(self) -> StepRecord:
        try:
            return self._train_step()
        except CollectiveError as e:
            # The comm layer names the op and the rank; the step says when (a peer hung or died).
            raise CollectiveError(f"step {self.step + 1}: {e}") from e

    def _train_step(self) -> StepRecord:
        cfg, comm, strategy = self.cfg.train, self.topo.dp, self.strategy
        measure_sync = self.cfg.ddp.measure_sync
        before = comm.totals()
        if measure_sync:
            comm.barrier()  # every rank starts the step together
        start = time.perf_counter()
        strategy.ledger.reset_peak()
        reset_device_peak(self.topo.device)
        self.model.train()
        strategy.zero_grad()
        loss_sum = torch.zeros((), dtype=torch.float64)
        for micro in range(cfg.grad_accum):
            last = micro == cfg.grad_accum - 1
            with contextlib.nullcontext() if last else strategy.no_sync():  # sync once per step
                x, y = self.loader.next_batch()
                loss = strategy.module(x.to(self.topo.device), y.to(self.topo.device))
                # Mean over this rank's tokens / accumulation; the strategy averages over ranks,
                # so the gradient is the mean over the global token count.
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach().double().cpu()
        bracketed = {}
        if measure_sync:
            backward_end = time.perf_counter()
            strategy.finish_grad_sync()
            comm.barrier()  # ...and ends when the slowest rank has its synced gradients
            done = time.perf_counter()
            # compute_and_sync: forward + backward + sync, barrier to barrier. sync_exposed: the part
            # after this rank's backward returned, i.e. communication not hidden behind compute.
            bracketed = {"compute_and_sync_s": done - start, "sync_exposed_s": done - backward_end}
        lr = lr_at(self.step, cfg)
        grad_norm = strategy.step(lr)
        skipped = not math.isfinite(grad_norm)
        self._check_skips(skipped)
        self.step += 1
        self.tokens_seen += self.tokens_per_step

        held, peak = strategy.memory_bytes(), strategy.peak_memory_bytes()
        peak["device"] = device_peak_bytes(self.topo.device)
        row = torch.tensor([float(loss_sum) / cfg.grad_accum, strategy.param_norm()]
                           + [float(held[k]) for k in MEMORY_KINDS] + [float(peak[k]) for k in PEAK_KINDS],
                           dtype=torch.float64)
        rows = comm.gather_rows(row)  # (world, 2 + 3 + 5), identical on every rank
        at_rest, peaks = rows[:, 2:2 + len(MEMORY_KINDS)].long(), rows[:, 2 + len(MEMORY_KINDS):].long()
        elapsed = time.perf_counter() - start
        after = comm.totals()
        return StepRecord(
            step=self.step,
            loss=float(rows[:, 0].mean()),
            grad_norm=grad_norm,
            param_norm=float(rows[0, 1]),
            lr=lr,
            tokens=self.tokens_per_step,
            tokens_seen=self.tokens_seen,
            step_time_s=elapsed,
            tokens_per_s=self.tokens_per_step / elapsed,
            comm_time_s=after.seconds - before.seconds,
            comm_bytes=after.bytes - before.bytes,
            comm_calls=after.calls - before.calls,
            param_norm_per_rank=rows[:, 1].tolist(),
            memory={k: at_rest[:, i].tolist() for i, k in enumerate(MEMORY_KINDS)},
            memory_peak={k: peaks[:, i].tolist() for i, k in enumerate(PEAK_KINDS)},
            sync={**strategy.last_sync, **bracketed},
            skipped=skipped,
        )

    def _check_skips(self, skipped: bool) -> None:
        """Count non-finite steps; every rank decides alike (the norm is global), so all abort together."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.skipped_steps += skipped
        if self.skipped_in_a_row > self.cfg.train.max_skipped_steps:
            raise NonFiniteError(f"step {self.step + 1}: gradients were NaN/Inf {self.skipped_in_a_row} steps in a "
                                 f"row (more than --train.max_skipped_steps {self.cfg.train.max_skipped_steps}); "
                                 "lower --lr, check the data, or resume from an earlier checkpoint")

    def train_state(self) -> dict:
        return {"step": self.step, "optimizer_steps": self.strategy.optimizer.steps_taken,
                "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict()}

    def save_checkpoint(self, root: str | Path) -> Path:
        return checkpoint.save(root, self.step, self.topo, self.strategy, self.train_state(), self.cfg.to_dict())

    def load_checkpoint(self, path: str | Path) -> None:
        state = checkpoint.load(path, self.topo, self.strategy)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.loader.load_state_dict(state["loader"])


def resume_path(cfg: RunConfig, warnings: list[str] | None = None) -> Path | None:
    """Where to resume from: None (fresh), the newest checkpoint under OUT that verifies (auto),
    or PATH."""
    if not cfg.ckpt.resume:
        return None
    if cfg.ckpt.resume == "auto":
        return checkpoint.find_latest(cfg.out, warnings)
    return checkpoint.resolve(cfg.ckpt.resume)


SCHEDULE_FIELDS = ("steps", "warmup_steps", "lr", "min_lr_ratio")


def check_resume(cfg: RunConfig) -> list[str]:
    """Before any rank starts: refuse a resume checkpoint that is corrupt or does not fit
    this run (ConfigError / CheckpointError, one line each); return notes worth printing.
    With --resume auto the checkpoint chosen here is pinned in cfg, so every rank loads it."""
    notes: list[str] = []
    path = resume_path(cfg, notes)
    if path is None:
        return notes
    cfg.ckpt.resume = str(path)
    step_dir, manifest = checkpoint.verify(path)
    saved = manifest["config"]
    mine = cfg.to_dict()
    diff = [k for k in mine["model"] if k != "preset" and saved["model"].get(k) != mine["model"][k]]
    if diff:
        raise checkpoint.CheckpointError(f"checkpoint {step_dir} has a different model: " + ", ".join(
            f"{k}={saved['model'].get(k)!r} (this run {mine['model'][k]!r})" for k in diff))
    if saved["train"]["dtype"] != cfg.train.dtype:
        raise checkpoint.CheckpointError(f"checkpoint {step_dir} was trained in {saved['train']['dtype']}, "
                                         f"this run uses {cfg.train.dtype}")
    if manifest["step"] >= cfg.train.steps:
        raise ConfigError(f"checkpoint {step_dir} is at step {manifest['step']}; ask for more --steps to continue")
    loader = manifest["train_state"]["loader"]
    global_batch = cfg.train.batch_size * cfg.dist.nproc
    if loader["global_batch"] != global_batch:
        fits = loader["global_batch"] % cfg.dist.nproc == 0
        hint = (f" (e.g. --batch-size {loader['global_batch'] // cfg.dist.nproc} with --nproc {cfg.dist.nproc})"
                if fits else "")
        raise ConfigError(f"checkpoint {step_dir} was saved with batch_size x ranks = {loader['global_batch']} "
                          f"examples per micro-batch, this run has {global_batch}; keep the product equal{hint} "
                          "so the data order continues exactly")
    if loader["seed"] != cfg.train.seed:
        raise ConfigError(f"checkpoint {step_dir} was saved with --seed {loader['seed']}, this run has "
                          f"{cfg.train.seed}; use the same seed to continue the same data order")
    if loader["num_examples"] != num_examples(cfg):
        raise ConfigError(f"checkpoint {step_dir} was trained on a corpus of {loader['num_examples']} examples, "
                          f"this run's corpus has {num_examples(cfg)}; resume with the same --corpus")
    changed = [f"{k} {saved['train'][k]} -> {mine['train'][k]}" for k in SCHEDULE_FIELDS
               if saved["train"][k] != mine["train"][k]]
    if changed:
        notes.append(f"learning-rate schedule differs from the checkpoint's run ({', '.join(changed)}): "
                     "training continues as a warm restart, not a bit-identical continuation")
    return notes


def train_worker(topo: Topology, cfg: RunConfig) -> dict:
    """What each rank runs for `minitrain train`. Rank 0 logs and returns the summary."""
    out = Path(cfg.out)
    trainer = Trainer(cfg, topo)
    start_path = resume_path(cfg)
    if start_path is not None:
        trainer.load_checkpoint(start_path)
    writer = MetricsWriter(out / "metrics.jsonl", resume_step=trainer.step if start_path else None) \
        if topo.is_main else None
    if topo.is_main and start_path is not None:
        print(f"resumed from {start_path} at step {trainer.step}", flush=True)
    saved, last, records = [], None, []
    total = cfg.train.steps
    cadence = SaveCadence(cfg, topo)
    while trainer.step < total:
        last = trainer.train_step()
        records.append(last)
        if writer:
            writer.write(asdict(last))
        if topo.is_main and cfg.train.log_every and (last.step % cfg.train.log_every == 0 or last.step == total):
            print(progress_line(last, total), flush=True)
        if cadence.due(last.step):
            saved.append(str(trainer.save_checkpoint(out / "checkpoints")))
            cadence.saved()
            if cfg.ckpt.keep_last and topo.is_main:
                checkpoint.prune(out / "checkpoints", cfg.ckpt.keep_last)
    if writer:
        writer.close()
    summary = {}
    if cfg.train.memory_profile and records and topo.is_main:
        report = memory.profile(trainer.strategy, records, topo.device)
        memory.write(report, out / "memory.json")
        print(memory.render(report), flush=True)
        summary["memory"] = str(out / "memory.json")
    return {**summary, "steps": trainer.step, "final_loss": None if last is None else last.loss,
            "sync": sync_report([r.sync for r in records], warmup=min(5, len(records) // 5)),
            "resumed_from": None if start_path is None else str(start_path),
            "checkpoints": saved, "metrics": str(out / "metrics.jsonl"),
            "params": trainer.strategy.flat.numel, "world_size": topo.world_size}


class SaveCadence:
    """When to checkpoint: every K steps, every M minutes, and at the last step if either is set.
    The clock is rank 0's, broadcast each step, so every rank agrees (a save is collective)."""

    def __init__(self, cfg: RunConfig, topo: Topology):
        self.every, self.minutes, self.total = cfg.ckpt.every_steps, cfg.ckpt.every_minutes, cfg.train.steps
        self.comm = topo.dp
        self.last = time.monotonic()

    def due(self, step: int) -> bool:
        if not (self.every or self.minutes):
            return False
        if step == self.total or (self.every and step % self.every == 0):
            return True
        if not self.minutes:
            return False
        flag = torch.tensor([float(time.monotonic() - self.last >= 60 * self.minutes)], device=self.comm.device)
        self.comm.broadcast(flag, src=0)
        return bool(flag.item())

    def saved(self) -> None:
        self.last = time.monotonic()


def progress_line(r: StepRecord, total: int) -> str:
    width = len(str(total))
    skipped = "  SKIPPED (NaN/Inf gradients, parameters unchanged)" if r.skipped else ""
    return (f"step {r.step:>{width}}/{total}  loss {r.loss:.4f}  grad_norm {r.grad_norm:.3f}  "
            f"lr {r.lr:.2e}  {r.tokens_per_s:,.0f} tok/s  comm {1000 * r.comm_time_s:.1f} ms{skipped}")
