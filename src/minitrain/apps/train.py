"""`minitrain train`: a flag for every setting of config/schema.py (the common ones with short spellings too),
the run checked and its --out locked before anything is written, the ranks launched (locally, or under
torchrun), and the run's summary printed."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from .. import checkpoint
from ..config import RunConfig, build_config, field_specs, load_toml, parse_bool
from ..data import corpus_vocab_size
from ..runtime.launch import check_local_ranks, launch, run_under_torchrun
from ..runtime.topology import under_torchrun
from ..train.metrics import clock, perplexity, phase_line, straggler_line
from ..train.offload_files import remove_offload_files
from ..train.run_config import check_run
from .out_dir import lock_out_dir, prepare_out_dir, refuse_a_used_out_dir

# Short spellings for the settings people change most; every field also has --section.name.
ALIASES = {
    "model.preset": "--preset", "dist.nproc": "--nproc", "train.steps": "--steps", "train.stop_at": "--stop-at",
    "train.seed": "--seed", "train.batch_size": "--batch-size", "train.grad_accum": "--grad-accum",
    "train.global_batch": "--global-batch", "train.lr": "--lr",
    "train.zero": "--zero", "train.dtype": "--dtype", "data.corpus": "--corpus",
    "ckpt.every_steps": "--ckpt-every-steps", "ckpt.resume": "--resume", "out": "--out",
    "ckpt.every_minutes": "--ckpt-every-minutes", "ckpt.keep_last": "--keep-last",
    "dist.backend": "--backend", "dist.timeout_s": "--timeout-s",
    "ddp.mode": "--dp", "ddp.bucket_mb": "--bucket-mb", "ddp.measure_sync": "--measure-sync",
    "train.prefetch": "--prefetch", "train.memory_profile": "--memory-profile",
    "ckpt.async_save": "--async-save", "train.spike_factor": "--spike-factor",
    "train.activation_checkpointing": "--activation-checkpointing",
    "train.precision": "--precision", "train.reduce_dtype": "--reduce-dtype", "dist.tp": "--tp", "dist.pp": "--pp",
    "dist.microbatches": "--microbatches", "dist.schedule": "--schedule",
    "eval.every": "--eval-every", "eval.batches": "--eval-batches",
}

TRAIN_EPILOG = """\
Settings resolve as: defaults < --preset < --config FILE < flags. A TOML file uses the
same sections as the flags, e.g.
  [model]
  preset = "tiny"
  [train]
  steps = 100
  zero = 1

Examples:
  minitrain train --nproc 4 --zero 1 --steps 50 --out runs/z1
  minitrain train --nproc 2 --corpus data/notes --preset small --eval-every 50 --out runs/notes
                                           # a `minitrain data prepare` directory, validated every 50 steps
  minitrain train --corpus data/notes --log.tensorboard --out runs/tb   # also TensorBoard event files
  minitrain train --nproc 4 --zero 3 --memory-profile --out runs/z3  # per-rank memory vs the formula
  minitrain train --nproc 2 --zero 1 --precision bf16 --out runs/bf16  # float32 master, 16-bit compute
  minitrain train --nproc 4 --tp 2 --pp 2 --microbatches 4 --model.n_layer 4 --out runs/3d
                                           # 2 tensor-parallel ranks x 2 pipeline stages, 1F1B
  minitrain train --nproc 2 --ckpt-every-steps 10 --out runs/a      # checkpoints every 10 steps
  minitrain train --ckpt-every-minutes 30 --keep-last 3 --out runs/b  # by the clock, newest 3 kept
  minitrain train --nproc 2 --resume auto --steps 40 --out runs/a   # continue the same run
  minitrain train --nproc 4 --ckpt-every-steps 50 --async-save --out runs/c  # saves written in the background
  torchrun --nproc-per-node=2 -m minitrain train --zero 1 --out runs/tr
  torchrun --nproc-per-node=2 --max-restarts=3 -m minitrain train --ckpt-every-steps 5 --out runs/e
                                           # a dead rank: torchrun restarts all, they resume from the last checkpoint

Fault tolerance: SIGTERM, SIGUSR1, SIGINT (Ctrl-C) or SIGHUP to any rank (or to the launcher) makes
every rank save a checkpoint at the next step boundary and exit 0; a second Ctrl-C stops at once. A step with NaN/Inf gradients is skipped on
every rank. A loss above --spike-factor x the running mean rolls back to the last checkpoint.

Writes under --out: metrics.jsonl (one JSON line per step, rank 0), config.json (the resolved
settings), env.json (versions, layout, git commit), tokenizer.json (the corpus's, if it has one),
checkpoints/step-NNNNNN/ (rank-RRRRR.safetensors + manifest.json) with a `latest` pointer (one
after the last step unless --no-final-save), and memory.json with --memory-profile.
Then: `minitrain export OUT OUT/model`, `minitrain sample OUT/model --prompt ...`, `minitrain report OUT`.
"""


def add_parser(sub) -> argparse.ArgumentParser:
    train = sub.add_parser("train", help="train with the settings you give",
                           description="Train MiniGPT with data parallel, ZeRO-1/2/3 or parameter servers, locally "
                           "(--nproc N) or under torchrun.", epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", metavar="FILE", help="TOML file of settings (flags override it)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, kind, default, help_text in field_specs():
        section = key.split(".")[0] if "." in key else "run"
        group = groups.get(section) or groups.setdefault(section, train.add_argument_group(f"{section} settings"))
        flags = ([ALIASES[key]] if key in ALIASES else []) + (["--" + key] if "." in key else [])
        switch = {"nargs": "?", "const": True} if kind is bool else {}  # `--flag` alone means true
        group.add_argument(*flags, dest=key, type=parse_bool if kind is bool else kind, default=argparse.SUPPRESS,
                           metavar=kind.__name__.upper(), help=f"{help_text} (default: {default!r})", **switch)
    groups["ckpt"].add_argument("--no-final-save", dest="ckpt.final_save", action="store_const", const=False,
                                default=argparse.SUPPRESS, help="no checkpoint after the last step")
    return train


def resolve_config(args) -> RunConfig:
    specs = {key for key, *_ in field_specs()}
    file_values = load_toml(args.config) if args.config else {}
    cli_values = {k: v for k, v in vars(args).items() if k in specs}
    cfg = build_config(file_values, cli_values, vocab_of=corpus_vocab_size)
    if under_torchrun():  # torchrun decides the world size
        cfg.dist.nproc = int(os.environ["WORLD_SIZE"])
        # A torchrun restart (--max-restarts) continues the run it replaces, never starts it over.
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not cfg.ckpt.resume:
            cfg.ckpt.resume = "auto"
    return check_run(cfg.validate())


def run(args) -> int:
    from ..data import eval_note
    from ..train.loop import train_worker
    from ..train.resume import RunFinished, check_resume

    cfg = resolve_config(args)
    if not under_torchrun():
        check_local_ranks(cfg.dist.nproc)
    speaks = not under_torchrun() or os.environ["RANK"] == "0"
    try:  # everything that may refuse the run reads only: a refused run writes nothing
        notes = check_resume(cfg) + [note for note in [eval_note(cfg)] if note]
    except RunFinished as done:
        if speaks:
            print(f"minitrain train: {done}")
        return 0
    if not cfg.ckpt.resume:
        refuse_a_used_out_dir(Path(cfg.out))
    out = prepare_out_dir(cfg.out)
    # Found now, not at the first save after a stretch of training: a checkpoint directory it cannot write (one
    # that is not there yet is made by the first save, in OUT, which is writable).
    if os.path.lexists(out / "checkpoints"):
        prepare_out_dir(out / "checkpoints", "the checkpoint directory")
    # One process per run holds the lock, the launcher or torchrun's rank 0, until the run is over.
    with lock_out_dir(out) if speaks else contextlib.nullcontext():
        for note in notes:
            if speaks:
                print(f"minitrain train: note: {note}", file=sys.stderr)
        return _train_and_report(cfg, train_worker)


def _train_and_report(cfg: RunConfig, train_worker) -> int:
    if under_torchrun():
        result = run_under_torchrun(train_worker, cfg, backend=cfg.dist.backend,
                                    pg_timeout_s=cfg.dist.timeout_s, threads_per_rank=cfg.dist.threads_per_rank)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        try:
            # --ps.elastic: the workers but worker 0 (the first nproc - servers ranks) may leave the run.
            leavers = range(1, cfg.dist.nproc - cfg.ps.servers) if cfg.ps.elastic else ()
            result = launch(train_worker, cfg.dist.nproc, cfg, backend=cfg.dist.backend,
                            pg_timeout_s=cfg.dist.timeout_s, threads_per_rank=cfg.dist.threads_per_rank,
                            may_leave=leavers)[0]
        finally:
            remove_offload_files(cfg)
    if cfg.ddp.measure_sync and result["sync"]:
        parts = [f"{name} mean {d['mean']:.3g} / p50 {d['p50']:.3g} / p95 {d['p95']:.3g}"
                 for name, d in result["sync"].items()]
        print("gradient sync after warmup: " + "; ".join(parts))
    if result.get("phases"):
        print(f"where a step went (rank 0, after warmup): {phase_line(result['phases'])}")
    if result.get("stragglers"):
        print(straggler_line(result["stragglers"]))
    if result.get("profile"):
        print(f"profiler traces (one per rank): {result['profile']}")
    if result["pipeline"]:
        p = result["pipeline"]
        print(f"pipeline bubble per stage (median, measured): {' '.join(f'{b:.0%}' for b in p['bubble'])}; "
              f"{p['schedule']}'s formula {p['expected_bubble']:.0%}; peak in-flight micro-batches per stage: "
              f"{' '.join(map(str, p['peak_in_flight']))}")
    ckpts = f"; last checkpoint {result['checkpoints'][-1]}" if result["checkpoints"] else ""
    final = "n/a" if result["final_loss"] is None else f"{result['final_loss']:.4f}"
    if result["best_val"]:
        best = result["best_val"]
        final += f", best val loss {best['loss']:.4f} (ppl {perplexity(best['loss'])}) at step {best['step']}"
    stopped = f" (stopped by {result['stopped_by']})" if result["stopped_by"] else ""
    if result["rollbacks"]:
        stopped += f" ({len(result['rollbacks'])} loss-spike rollback(s))"
    print(f"done: {result['steps']} step{'s' if result['steps'] != 1 else ''}{stopped} on {result['world_size']} rank(s) in {clock(result['elapsed_s'])}, "
          f"final loss {final}; metrics {result['metrics']}{ckpts}")
    return 0


def what_is_lost(args) -> str:
    """For an interrupted training run: its newest checkpoint, after which the work is lost."""
    out = getattr(args, "out", None)
    if args.command != "train" or not out:
        return ""
    latest = Path(out) / "checkpoints" / checkpoint.LATEST
    name = latest.read_text().strip() if latest.is_file() and not latest.is_symlink() else None
    if name is None:
        return f" at once: no checkpoint of the run in {out} yet, its steps are lost"
    return (f" at once: what was trained after {Path(out) / 'checkpoints' / name} is lost; --resume auto continues "
            "from there")
