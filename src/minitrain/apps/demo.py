"""`minitrain demo`: the whole foundation in one run, with its invariants checked.

N ranks (default 4) train the tiny GPT with data parallel + ZeRO-1 for S steps
(default 20), save a sharded checkpoint at step S/2, and continue. Then every
rank builds a fresh trainer, reloads the checkpoint, checks it byte-equal to
the state it held when saving, trains to step S again, and checks the loss
and every parameter and optimizer byte against the first run.

The corpus is exactly one global batch (batch 4 per rank), so each step is a
full-batch step on a fixed objective; with a small, decaying learning rate its
loss must fall every step, which is invariant (a).
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config import ConfigError, RunConfig
from ..train.run_config import check_run
from ..runtime.launch import launch
from ..train.metrics import MetricsWriter, format_table, human_bytes
from ..parallel.core.sync_stats import same_state
from ..runtime.topology import Topology
from ..train.trainer import Trainer
from .out_dir import prepare_out_dir

LOSS_RISE_TOLERANCE = 1e-6  # relative: float32 reductions reorder sums at ~1e-7
DEMO_MARKER = ".minitrain-demo"  # written first; only directories holding it are ever cleared
DEMO_OUTPUTS = ("metrics.jsonl", "checkpoints", "report.json")


@dataclass
class DemoOptions:
    world_size: int = 4
    steps: int = 20
    out: str = "runs/demo"


def demo_config(opts: DemoOptions) -> RunConfig:
    cfg = RunConfig(out=opts.out)
    cfg.dist.nproc = opts.world_size
    cfg.dist.backend = "gloo"  # the CPU demo, also on machines that have GPUs
    t = cfg.train
    t.steps, t.zero, t.log_every = opts.steps, 1, 0
    t.lr, t.min_lr_ratio, t.warmup_steps = 3e-3, 0.1, 2
    # One global batch of examples: every step sees the whole corpus, split across ranks.
    cfg.data.synthetic_tokens = t.batch_size * opts.world_size * cfg.model.seq_len + 1
    cfg.ckpt.every_steps = max(1, opts.steps // 2)
    return check_run(cfg.validate())


def _train_worker(topo: Topology, cfg: RunConfig) -> dict | None:
    """One rank of the demo (spawned by `launch`): train straight through (the strategy broadcasts rank 0's
    initial parameters, each step is the ZeRO step), write the sharded checkpoint half way, then verify_resume.
    Returns rank 0's report (None on the others)."""
    out, steps = Path(cfg.out), cfg.train.steps
    ckpt_step = cfg.ckpt.every_steps
    start = time.perf_counter()

    # Run A: straight through, checkpoint at ckpt_step.
    trainer = Trainer(cfg, topo)
    writer = MetricsWriter(out / "metrics.jsonl") if topo.is_main else None
    records, ckpt_dir, saved_state = [], None, None
    while trainer.step < steps:
        rec = trainer.train_step()
        records.append(rec)
        if writer:
            writer.write(asdict(rec))
        if rec.step == ckpt_step:
            ckpt_dir = trainer.save_checkpoint(out / "checkpoints")
            saved_state = trainer.strategy.state_snapshot()
    if writer:
        writer.close()
    final_state = trainer.strategy.state_snapshot()
    trainer.close()  # done training: its hooks off the model
    run_seconds = time.perf_counter() - start

    reload_equal, resume_equal, resumed_records = verify_resume(topo, cfg, ckpt_dir, saved_state, final_state,
                                                                [r.loss for r in records[ckpt_step:]])
    verdicts = topo.dp.gather_rows(torch.tensor([reload_equal, resume_equal], dtype=torch.int64))
    if not topo.is_main:
        return None
    return {
        "world_size": topo.world_size,
        "steps": steps,
        "checkpoint_step": ckpt_step,
        "checkpoint_dir": str(ckpt_dir),
        "params": trainer.strategy.flat.numel,
        "padded_params": trainer.strategy.flat.padded_numel,
        "padding": trainer.strategy.flat.padding,
        "records": [asdict(r) for r in records],
        "resumed_losses": [r.loss for r in resumed_records],
        "expected_memory": trainer.strategy.expected_memory_bytes(),
        "reload_equal_per_rank": [bool(v) for v in verdicts[:, 0].tolist()],
        "resume_equal_per_rank": [bool(v) for v in verdicts[:, 1].tolist()],
        "train_seconds": run_seconds,
    }


def verify_resume(topo: Topology, cfg: RunConfig, ckpt_dir: Path, saved_state: dict, final_state: dict,
                  later_losses: list[float]) -> tuple[bool, bool, list]:
    """Run B, in this process: a fresh trainer reloads the checkpoint; (its state equals, byte for byte, the
    snapshot taken when saving (the master shards and Adam's moments included); training on to the last step
    gives the same losses and the same final bytes; the resumed records)."""
    resumed = Trainer(cfg, topo)
    resumed.load_checkpoint(ckpt_dir)
    reload_equal = same_state(resumed.strategy.state_snapshot(), saved_state) and resumed.step == cfg.ckpt.every_steps
    resumed_records = [resumed.train_step() for _ in range(cfg.train.steps - resumed.step)]
    resume_equal = (same_state(resumed.strategy.state_snapshot(), final_state)
                    and [r.loss for r in resumed_records] == later_losses)
    resumed.close()
    return reload_equal, resume_equal, resumed_records


# --- the parent process: run, check, print ---------------------------------------------------
def check_invariants(report: dict) -> list[tuple[str, bool, str]]:
    """(name, passed, explanation) for invariants (a)-(d)."""
    recs, n = report["records"], report["world_size"]
    losses = [r["loss"] for r in recs]
    rises = [(i + 2, b - a) for i, (a, b) in enumerate(zip(losses, losses[1:])) if b > a + LOSS_RISE_TOLERANCE * abs(a)]
    worst = max((b - a for a, b in zip(losses, losses[1:])), default=0.0)
    a = ("(a) loss non-increasing step to step", not rises,
         f"largest step-to-step change {worst:+.3e}; tolerance {LOSS_RISE_TOLERANCE:g} x loss"
         + (f"; rose at step {rises[0][0]} by {rises[0][1]:.3e}" if rises else ""))
    uneven = [r["step"] for r in recs if len(set(r["param_norm_per_rank"])) != 1]
    b = ("(b) parameter norm bit-identical on every rank", not uneven,
         f"{n} ranks x {len(recs)} steps compared as exact float64 values"
         + (f"; differs at steps {uneven[:5]}" if uneven else ""))
    want = report["expected_memory"]["optimizer"]
    got = recs[-1]["memory"]["optimizer"]
    c = ("(c) optimizer bytes per rank == 12P/N", all(g == want for g in got),
         f"12 x {report['padded_params']} / {n} = {want} bytes; measured {sorted(set(got))}")
    reload_ok, resume_ok = all(report["reload_equal_per_rank"]), all(report["resume_equal_per_rank"])
    d = ("(d) checkpoint reloads byte-equal; resumed run bit-identical", reload_ok and resume_ok,
         f"step-{report['checkpoint_step']} state reloaded byte-equal on ranks {_ranks(report['reload_equal_per_rank'])}; "
         f"resume to step {report['steps']}: loss and all parameter/optimizer bytes equal on ranks "
         f"{_ranks(report['resume_equal_per_rank'])}")
    return [a, b, c, d]


def _ranks(flags: list[bool]) -> str:
    good = [i for i, f in enumerate(flags) if f]
    return f"{good} of {len(flags)}" if good else f"none of {len(flags)}"


def render(report: dict, checks: list[tuple[str, bool, str]], out: Path) -> str:
    recs, n = report["records"], report["world_size"]
    lines = []
    rows = [[r["step"], f"{r['loss']:.6f}", f"{r['grad_norm']:.4f}", f"{r['lr']:.2e}", f"{r['param_norm']:.6f}",
             f"{1000 * r['step_time_s']:.1f}", f"{1000 * r['comm_time_s']:.1f}", r["comm_calls"],
             "checkpoint saved" if r["step"] == report["checkpoint_step"] else ""] for r in recs]
    lines += ["", "Loss per step (global mean over all ranks)",
              format_table(["step", "loss", "grad_norm", "lr", "param_norm", "step_ms", "comm_ms", "collectives", ""],
                           rows, ">>>>>>>><")]
    exp = report["expected_memory"]
    mem = recs[-1]["memory"]
    rows = [[r, mem["params"][r], mem["grads"][r], mem["optimizer"][r], exp["optimizer"],
             "yes" if mem["optimizer"][r] == exp["optimizer"] else "NO"] for r in range(n)]
    lines += ["", f"Per-rank memory at rest, bytes (P = {report['padded_params']} padded params, "
                  f"padding {report['padding']}, N = {n}; fp32 master + Adam m + v = 12 bytes/param)",
              format_table(["rank", "params", "grads", "optimizer", "expected 12P/N", "match"], rows)]
    manifest = json.loads((Path(report["checkpoint_dir"]) / "manifest.json").read_text())
    total = sum(f["bytes"] for f in manifest["files"])
    lines += ["", f"Checkpoint {report['checkpoint_dir']} (manifest.json)",
              f"  step {manifest['step']}, world size {manifest['world_size']}, strategy {manifest['strategy']}, "
              f"{len(manifest['files'])} shard files, {human_bytes(total)}, {len(manifest['tensors'])} tensors",
              format_table(["file", "bytes", "sha256"],
                           [[f["name"], f["bytes"], f["sha256"][:16] + "..."] for f in manifest["files"]], "<><")]
    lines += ["", "Invariants"] + [f"  [{'PASS' if ok else 'FAIL'}] {name}: {why}" for name, ok, why in checks]
    return "\n".join(lines)


def check_demo_dir(out: Path) -> None:
    """The demo clears its own earlier outputs, so it refuses a directory that holds anything else."""
    if out.is_dir() and any(out.iterdir()) and not (out / DEMO_MARKER).exists():
        raise ConfigError(f"{out} is not empty and was not written by `minitrain demo`; "
                          "choose a new or empty --out")


def run_demo(opts: DemoOptions) -> int:
    """Run the demo, print its report; 0 when every invariant holds, else 1."""
    cfg = demo_config(opts)
    out = Path(cfg.out)
    check_demo_dir(out)
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).touch()
    for name in DEMO_OUTPUTS:  # outputs of an earlier demo in the same directory
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    print(f"minitrain demo: {opts.world_size} ranks (gloo, CPU, 1 thread each), data parallel + ZeRO-1, "
          f"tiny GPT, {opts.steps} steps, checkpoint at step {cfg.ckpt.every_steps}, outputs in {out}/", flush=True)
    report = launch(_train_worker, opts.world_size, cfg, backend=cfg.dist.backend,
                    pg_timeout_s=cfg.dist.timeout_s)[0]
    checks = check_invariants(report)
    print(render(report, checks, out))
    (out / "report.json").write_text(json.dumps({**report, "invariants": [
        {"name": name, "passed": ok, "detail": why} for name, ok, why in checks]}, indent=1))
    elapsed = time.perf_counter() - start
    if all(ok for _, ok, _ in checks):
        print(f"\nRESUME VERIFIED  ({elapsed:.1f} s wall, training {report['train_seconds']:.1f} s; "
              f"metrics: {out / 'metrics.jsonl'}, report: {out / 'report.json'})")
        return 0
    failed = ", ".join(name.split(")")[0] + ")" for name, ok, _ in checks if not ok)
    print(f"\nDEMO FAILED: invariant {failed} violated (see above); {elapsed:.1f} s")
    return 1


def add_parser(sub) -> argparse.ArgumentParser:
    demo = sub.add_parser("demo", help="4 ranks, DP + ZeRO-1, 20 steps, checkpoint, resume verified",
                          description="Train the tiny GPT on N ranks with data parallel + ZeRO-1, save a sharded "
                          "checkpoint half way, resume from it, and verify four invariants: loss falls, "
                          "ranks agree bit for bit, optimizer memory is 12P/N, resume is bit-identical.")
    demo.add_argument("--world-size", type=int, default=4, metavar="N", help="ranks to spawn (default 4)")
    demo.add_argument("--steps", type=int, default=20, metavar="S", help="steps; checkpoint at S/2 (default 20)")
    demo.add_argument("--out", default="runs/demo", metavar="DIR", help="output directory (default runs/demo)")

    return demo


def run(args) -> int:
    if args.world_size < 1:
        raise ConfigError(f"world size must be at least 1 (got --world-size {args.world_size})")
    if args.steps < 2:
        raise ConfigError(f"the demo needs at least 2 steps to checkpoint half way and resume (got --steps {args.steps})")
    check_demo_dir(Path(args.out))
    prepare_out_dir(args.out)
    return run_demo(DemoOptions(world_size=args.world_size, steps=args.steps, out=args.out))
