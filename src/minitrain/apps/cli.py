"""`minitrain demo | train`: parse, validate, launch. Thin on purpose.

Bad input exits 2 with one line saying what to fix, before anything is
written. A failed rank exits 1 with that rank's traceback, shown once.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from ..version import __version__
from .. import checkpoint
from ..corpus import prepare as prepare_data
from . import report
from ..bench.comm import OPS as COMM_OPS
from ..config import (
    ConfigError,
    RunConfig,
    build_config,
    field_specs,
    load_toml,
    parse_bool,
)
from ..data import corpus_vocab_size
from ..train.run_config import check_run, run_config
from ..runtime.launch import (
    LaunchTimeoutError,
    RankFailedError,
    check_local_ranks,
    launch,
    run_under_torchrun,
)
from ..train.metrics import clock, perplexity, phase_line, straggler_line
from ..parallel.schedules import SCHEDULES, render_timeline
from ..runtime.topology import under_torchrun

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


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> Parser:
    parser = Parser(prog="minitrain", description="Small, exactly correct distributed training for GPT-style models.")
    parser.add_argument("--version", action="version", version=f"minitrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")

    demo = sub.add_parser("demo", help="4 ranks, DP + ZeRO-1, 20 steps, checkpoint, resume verified",
                          description="Train the tiny GPT on N ranks with data parallel + ZeRO-1, save a sharded "
                          "checkpoint half way, resume from it, and verify four invariants: loss falls, "
                          "ranks agree bit for bit, optimizer memory is 12P/N, resume is bit-identical.")
    demo.add_argument("--world-size", type=int, default=4, metavar="N", help="ranks to spawn (default 4)")
    demo.add_argument("--steps", type=int, default=20, metavar="S", help="steps; checkpoint at S/2 (default 20)")
    demo.add_argument("--out", default="runs/demo", metavar="DIR", help="output directory (default runs/demo)")

    bench = sub.add_parser("bench", help="measurements: scaling, comm, throughput", description="Measurements that write their "
                           "figures, plots and raw timings to a directory.")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=Parser, metavar="BENCH")
    scaling = bench_sub.add_parser("scaling", help="tokens/s with 1 vs N processes, and why",
                                   description="Train the same model with 1 and with 2 processes (4 with "
                                   "--max-procs 4), gloo on CPU, and explain the measured scaling from the "
                                   "compute and communication times. Writes timings.jsonl, "
                                   "state-rank-*.safetensors, scaling.png and manifest.json under --out.")
    scaling.add_argument("--out", default="runs/scaling", metavar="DIR", help="output directory (default runs/scaling)")
    scaling.add_argument("--steps", type=int, default=100, help="steps per run (default 100)")
    scaling.add_argument("--max-procs", type=int, default=2, choices=(2, 4), help="largest world size (default 2)")
    scaling.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    scaling.add_argument("--batch-size", type=int, default=4, help="examples per rank per step (default 4)")
    comm = bench_sub.add_parser("comm", help="time, algbw and busbw of each collective; alpha-beta fit",
                                description="Time all_reduce, all_gather, reduce_scatter, broadcast and all_to_all "
                                "from 1 KiB to --max-mb MiB on N ranks (gloo on CPU, NCCL with a GPU per rank); "
                                "report algbw and busbw as nccl-tests defines them, and fit t = alpha + factor*S/beta "
                                "per op. Writes comm.json and comm.png under --out.")
    comm.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks (default 2)")
    comm.add_argument("--max-mb", type=float, default=64.0, metavar="M", help="largest size in MiB (default 64)")
    comm.add_argument("--ops", nargs="+", choices=COMM_OPS, default=list(COMM_OPS), metavar="OP",
                      help=f"a subset of: {' '.join(COMM_OPS)} (default all)")
    comm.add_argument("--out", default="runs/bench-comm", metavar="DIR", help="output directory (default runs/bench-comm)")
    speed = bench_sub.add_parser(
        "throughput", help="one process: minitrain's trainer against a plain PyTorch loop; tokens/s and MFU",
        description="Train the same model (same weights, data, schedule, clipping) with minitrain's trainer and "
        "with the loop a PyTorch user writes (fused AdamW, clip_grad_norm_, autocast), alternating in rounds; "
        "report tokens/s of each, their ratio, and MFU (6N + 12LhT FLOPs per token over the device's peak: the "
        "data sheet on A100/H100/H200, a measured matrix multiply elsewhere). Writes throughput.json under --out.",
        epilog="Example: minitrain bench throughput --preset small --precision fp32 bf16; on a GPU: minitrain bench "
        "throughput --preset gpt2-124m --precision bf16 --compile")
    speed.add_argument("--preset", default="small", help="model preset: tiny | small | gpt2-124m (default small)")
    speed.add_argument("--precision", nargs="+", default=["fp32"], metavar="P",
                       help="one configuration per value: fp32 | bf16 (default fp32)")
    speed.add_argument("--compile", action="store_true", help="torch.compile each block, on both sides")
    speed.add_argument("--batch-size", type=int, default=8, help="examples per step (default 8)")
    speed.add_argument("--steps", type=int, default=5, help="measured steps per side and round (default 5)")
    speed.add_argument("--rounds", type=int, default=3, help="rounds, alternating which side goes first (default 3)")
    speed.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side first (default 2)")
    speed.add_argument("--out", default="runs/bench-throughput", metavar="DIR",
                       help="output directory (default runs/bench-throughput)")

    ckpt = sub.add_parser("ckpt", help="inspect, verify or consolidate a checkpoint",
                          description="Look into a sharded checkpoint. PATH is a step directory, a checkpoints/ "
                          "directory or a run directory (its `latest` is used). Exit 1 if it does not verify.")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt", required=True, parser_class=Parser, metavar="ACTION")
    for action, text in (("inspect", "step, topology, files and tensors"),
                         ("verify", "every file's size and sha256 against the manifest")):
        ckpt_sub.add_parser(action, help=text, description=text).add_argument("path", metavar="PATH")
    merge = ckpt_sub.add_parser("consolidate", help="one plain state dict that MiniGPT.load_state_dict accepts",
                                description="Write the parameters as one safetensors state dict, whatever world "
                                "size and ZeRO stage saved them.")
    merge.add_argument("path", metavar="PATH")
    merge.add_argument("out", metavar="OUT.safetensors")

    export = sub.add_parser("export", help="a run's newest checkpoint as a model directory: weights, config, tokenizer",
                            description="Write OUT: model.safetensors (the consolidated parameters under the model's "
                            "own keys, from any world size or layout), config.json and the corpus's tokenizer.json; "
                            "`minitrain sample OUT` needs nothing else. RUN_OR_CKPT: a run directory (its newest "
                            "checkpoint that verifies) or a checkpoint directory.",
                            epilog="Example:\n  minitrain export runs/notes runs/notes/model",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("source", metavar="RUN_OR_CKPT", help="a run directory, or a checkpoints/ or step-NNNNNN "
                        "directory")
    export.add_argument("out", metavar="OUT", help="the directory to write (must not exist, or be empty)")
    sampler = sub.add_parser("sample", help="generate text from an exported model",
                             description="Load a directory `minitrain export` wrote and continue --prompt. The same "
                             "--seed gives the same text. A model trained on a synthetic corpus has no tokenizer: "
                             "its prompt and output are token ids.",
                             epilog='Example:\n  minitrain sample runs/notes/model --prompt "The river" '
                             "--max-new-tokens 80 --temperature 0.8 --top-k 40 --seed 1",
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    sampler.add_argument("model_dir", metavar="DIR", help="a directory `minitrain export` wrote")
    sampler.add_argument("--prompt", default="", help="text to continue ('' = start of a document)")
    sampler.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate (default 100)")
    sampler.add_argument("--temperature", type=float, default=1.0, metavar="T",
                         help="divides the logits; lower is more predictable, 0 = always the most likely (default 1)")
    sampler.add_argument("--top-k", type=int, default=40, metavar="K", help="draw from the K most likely tokens; "
                         "0 = all (default 40)")
    sampler.add_argument("--seed", type=int, default=0, metavar="S", help="the draw's seed (default 0)")

    prepare_data.add_parser(sub)
    report.add_parser(sub)

    planner = sub.add_parser("plan", help="memory per rank and step time, before launching",
                             description="Predict per-rank bytes (parameters, gradients, optimizer state, "
                             "activations) and the step time (compute at an MFU, each collective from an "
                             "alpha-beta model, pipeline bubble) for a model and a layout. Describe the model by "
                             "--preset (with overrides) or by a raw --params count.",
                             epilog="Examples:\n  minitrain plan --preset gpt2-124m --dp 8 --zero 1 --precision bf16\n"
                             "  minitrain plan --params 7.5e9 --dp 64 --zero 3 --precision fp16 --reduce-dtype compute  # the ZeRO paper's "
                             "example\n  minitrain bench comm --out runs/bench-comm && minitrain plan --hardware "
                             "cpu-here --dp 2 --zero 1", formatter_class=argparse.RawDescriptionHelpFormatter)
    planner.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    for flag, field_name in (("--layers", "n_layer"), ("--d-model", "d_model"), ("--heads", "n_head"),
                             ("--vocab", "vocab_size"), ("--seq", "seq_len"), ("--d-ff", "d_ff")):
        planner.add_argument(flag, dest=f"model_{field_name}", type=int, help=f"override the preset's {field_name}")
    planner.add_argument("--params", type=float, help="a raw parameter count instead of a model (e.g. 7.5e9); "
                         "activations are then not estimated")
    planner.add_argument("--micro-batch", type=int, default=1, help="examples per rank per micro-batch (default 1)")
    planner.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    planner.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    planner.add_argument("--reduce-dtype", choices=("fp32", "compute"), default="fp32",
                         help="what gradients are summed in with bf16/fp16 (the ZeRO paper's figures: compute)")
    for flag in ("--dp", "--tp", "--pp"):
        planner.add_argument(flag, type=int, default=1, help="parallel degree (default 1)")
    planner.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    planner.add_argument("--activation-checkpointing", choices=("none", "block", "selective"), default="none")
    planner.add_argument("--microbatches", type=int, default=1, help="pipeline micro-batches (default 1)")
    planner.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    planner.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed (default 0.4)")
    planner.add_argument("--hardware", choices=("a100-80g", "h100-sxm", "cpu-here"), default="h100-sxm")
    planner.add_argument("--comm-json", default="runs/bench-comm/comm.json",
                         help="cpu-here: `minitrain bench comm` output to fit alpha and beta from")
    planner.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    pipe = sub.add_parser("pp-schedule", help="a pipeline schedule's timeline, bubble and in-flight micro-batches",
                          description="Print what each pipeline stage does at each tick of an ideal clock (a "
                          "forward takes one tick, communication is free): F3 = forward of micro-batch 3, "
                          "B3 its backward, . idle. Then each stage's bubble against (P-1)/(M+P-1) and the most "
                          "micro-batches whose activations it holds at once. The executor runs the same lists.",
                          epilog="Examples:\n  minitrain pp-schedule --pp 4 --microbatches 8 --schedule 1f1b\n"
                          "  minitrain pp-schedule --pp 4 --microbatches 8 --schedule gpipe --backward-cost 2",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe.add_argument("--pp", type=int, default=4, metavar="P", help="pipeline stages (default 4)")
    pipe.add_argument("--microbatches", type=int, default=8, metavar="M", help="micro-batches per step (default 8)")
    pipe.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b", help="default 1f1b")
    pipe.add_argument("--backward-cost", type=int, default=1, metavar="TICKS",
                      help="ticks a backward takes, a forward taking 1 (default 1; about 2 in practice)")

    train = sub.add_parser("train", help="train with the settings you give",
                           description="Train MiniGPT with data parallel or ZeRO-1/2/3, locally (--nproc N) or "
                           "under torchrun.", epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "ckpt":
            return cmd_ckpt(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "pp-schedule":
            return cmd_pp_schedule(args)
        if args.command == "data":
            return prepare_data.run(args)
        if args.command == "report":
            return report.run(args)
        if args.command == "export":
            from .export import export

            print(export(args.source, args.out))
            return 0
        if args.command == "sample":
            from .sample import sample

            print(sample(args.model_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
            return 0
        return cmd_train(args)
    except (ConfigError, checkpoint.CheckpointError) as e:
        print(f"minitrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RankFailedError as e:
        print(f"minitrain {args.command}: {e}", file=sys.stderr)
        return 1
    except LaunchTimeoutError as e:
        print(f"minitrain {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"minitrain {args.command}: interrupted{_what_is_lost(args)}", file=sys.stderr)
        return 130


def _what_is_lost(args) -> str:
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


def prepare_out_dir(path: str | Path, what: str = "output directory") -> Path:
    """Create the directory and prove it writable, or raise ConfigError."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write to {what} {out}: {e.strerror or e}") from None
    return out


def refuse_a_used_out_dir(out: Path) -> None:
    """A run without --resume starts from step 0: refuse an --out that holds another run's metrics or
    checkpoints rather than overwrite the one and mix two models in the other."""
    checkpoints = out / "checkpoints"
    saved = any(checkpoints.glob("step-*")) or os.path.lexists(checkpoints / "latest")  # not a crashed save's .tmp
    used = [name for name, there in (("metrics.jsonl", (out / "metrics.jsonl").exists()), ("checkpoints", saved))
            if there]
    if used:
        raise ConfigError(f"--out {out} already holds a run ({' and '.join(used)}); continue it with --resume auto, "
                          "or choose an empty --out")


@contextlib.contextmanager
def lock_out_dir(out: Path):
    """Hold an exclusive lock on OUT/.lock while the block runs (the kernel also drops it when the process
    ends, however it ends): two runs writing one --out would interleave their metrics and checkpoints."""
    import fcntl

    try:  # never through a symbolic link: a planted one would have the run truncate whatever it points at
        fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot open its .lock ({e.strerror or e}"
                          f"{'; it is a symbolic link: remove it' if os.path.islink(out / '.lock') else ''})") from None
    with os.fdopen(fd, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ConfigError(f"--out {out} is in use by another minitrain run ({holder}); wait for it, or choose "
                              "another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield  # closing the file at the end releases the lock


def cmd_demo(args) -> int:
    from .demo import DemoOptions, check_demo_dir, run_demo

    if args.world_size < 1:
        raise ConfigError(f"world size must be at least 1 (got --world-size {args.world_size})")
    if args.steps < 2:
        raise ConfigError(f"the demo needs at least 2 steps to checkpoint half way and resume (got --steps {args.steps})")
    check_demo_dir(Path(args.out))
    prepare_out_dir(args.out)
    return run_demo(DemoOptions(world_size=args.world_size, steps=args.steps, out=args.out))


def cmd_bench(args) -> int:
    from ..bench.scaling import ScalingOptions, run_scaling

    if args.bench == "throughput":
        from ..bench.throughput import (
            ThroughputOptions,
            check_throughput_options,
            run_throughput,
        )

        opts = ThroughputOptions(out=args.out, preset=args.preset, precisions=args.precision, compile=args.compile,
                                 batch_size=args.batch_size, steps=args.steps, rounds=args.rounds, warmup=args.warmup)
        check_throughput_options(opts)
        prepare_out_dir(args.out)
        return run_throughput(opts)
    if args.bench == "comm":
        from ..bench.comm import CommOptions, check_comm_options, run_comm

        opts = CommOptions(nproc=args.nproc, max_mb=args.max_mb, out=args.out, ops=tuple(args.ops))
        check_comm_options(opts)
        prepare_out_dir(args.out)
        return run_comm(opts)
    if args.steps < 10:
        raise ConfigError(f"bench scaling needs at least 10 steps to measure past warmup (got --steps {args.steps})")
    prepare_out_dir(args.out)
    return run_scaling(ScalingOptions(out=args.out, steps=args.steps, max_procs=args.max_procs,
                                      preset=args.preset, batch_size=args.batch_size))


def cmd_ckpt(args) -> int:
    from . import ckpt as ckpt_tool

    try:
        if args.ckpt == "inspect":
            print(ckpt_tool.inspect(args.path))
        elif args.ckpt == "verify":
            print(ckpt_tool.verify(args.path))
        else:
            print(ckpt_tool.consolidate(args.path, args.out))
    except checkpoint.CheckpointError as e:  # a failed check, not a usage error
        print(f"minitrain ckpt {args.ckpt}: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_plan(args) -> int:
    import json

    from ..train import estimate as plan
    from ..config import PRESETS

    for name in ("micro_batch", "grad_accum", "dp", "tp", "pp", "microbatches"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must lie in (0, 1], got {args.mfu}")
    if args.params is not None:
        if not args.params >= 1:
            raise ConfigError(f"--params must be a positive count, got {args.params:g}")
        model, params = None, args.params
    else:
        if args.preset not in PRESETS:
            raise ConfigError(f"unknown preset '{args.preset}'; choose one of: {', '.join(PRESETS)}")
        overrides = {k.removeprefix("model_"): v for k, v in vars(args).items() if k.startswith("model_") and v}
        values = {"model.preset": args.preset, **{f"model.{k}": v for k, v in overrides.items()}}
        model = run_config(cli_values=values).model
        params = plan.model_params(model)
    hardware = plan.cpu_here(args.comm_json) if args.hardware == "cpu-here" else plan.PRESETS[args.hardware]
    inp = plan.PlanInput(model=model, params=params, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                         precision=args.precision, reduce_dtype=args.reduce_dtype, dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero,
                         activation_checkpointing=args.activation_checkpointing, microbatches=args.microbatches,
                         schedule=args.schedule, mfu=args.mfu, hardware=hardware,
                         seq_len=args.model_seq_len or 1024)
    result = plan.plan(inp)
    print(json.dumps(result) if args.json else plan.render(result))
    return 0


def cmd_pp_schedule(args) -> int:
    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches), ("--backward-cost", args.backward_cost)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    print(render_timeline(args.schedule, SCHEDULES[args.schedule](args.pp, args.microbatches), 1, args.backward_cost))
    return 0


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


def cmd_train(args) -> int:
    from ..data import eval_note
    from ..train.loop import RunFinished, check_resume, train_worker

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
        result = launch(train_worker, cfg.dist.nproc, cfg, backend=cfg.dist.backend, pg_timeout_s=cfg.dist.timeout_s,
                        threads_per_rank=cfg.dist.threads_per_rank)[0]
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
              f"(P-1)/(M+P-1) = {p['expected_bubble']:.0%}; peak in-flight micro-batches per stage: "
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
