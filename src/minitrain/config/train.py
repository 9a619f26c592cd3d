"""The sections of the training loop: train (steps, batch, optimizer, precision, ZeRO stage, memory, guards),
eval and log, with the checks each makes of its own settings. check_batch derives each rank's batch from
--global-batch, which needs the run's layout as well."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .fields import opt, require_choice, require_non_negative, require_positive

if TYPE_CHECKING:  # the type only: schema.py puts the sections together and imports this module
    from .schema import RunConfig


@dataclass
class TrainConfig:
    steps: int = opt(20, "optimizer steps to run (total, counting steps before a resume)")
    stop_at: int = opt(0, "end this run after step K with a checkpoint, as a stop signal would (the learning-rate "
                       "schedule still spans --steps; --resume auto continues): cuts a long run into jobs that fit "
                       "a scheduler's time limit; 0 = run to --steps")
    batch_size: int = opt(4, "examples per rank per micro-batch")
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step")
    global_batch: int = opt(0, "examples per optimizer step over every data-parallel rank; when set, each rank's "
                            "batch_size is this / (data-parallel ranks x grad_accum), so a run that torchrun "
                            "restarts at another world size (--nnodes MIN:MAX) keeps its data order and step "
                            "arithmetic; 0 = batch_size x grad_accum x data-parallel ranks")
    lr: float = opt(3e-3, "peak learning rate (reached after warmup)")
    min_lr_ratio: float = opt(0.1, "learning rate at the end of the cosine decay, as a fraction of lr")
    warmup_steps: int = opt(2, "linear warmup steps")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay, applied to matrices only")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 disables clipping")
    seed: int = opt(0, "seed for initialisation and data order; same seed, same run, bit for bit")
    dtype: str = opt("float32", "float32 | float64 (float64 is for exact parity checks); the optimizer's master "
                     "weights and state are kept in this dtype whatever --precision is")
    precision: str = opt("fp32", "fp32 (compute in --dtype) | bf16 | fp16: parameters and gradients in 16 bits, "
                         "forward under autocast, float32 master weights in the optimizer; fp16 adds loss scaling")
    reduce_dtype: str = opt("fp32", "fp32 | compute: the dtype gradients are summed across ranks in (with bf16/fp16; "
                            "compute halves the traffic and, at ZeRO-2/3, the gradient shard)")
    loss_scale_init: float = opt(65536.0, "fp16: the initial loss scale (a power of two)")
    loss_scale_window: int = opt(1000, "fp16: double the loss scale after this many steps without overflow (an "
                                 "overflow halves it and skips the step)")
    zero: int = opt(0, "ZeRO stage: 0 = data parallel (everything replicated), 1 = optimizer state sharded, "
                    "2 = gradients too, 3 = parameters too (gathered one block at a time)")
    activation_checkpointing: str = opt("none", "none | block (keep each block's input, recompute the block in "
                                        "backward) | selective (recompute only the attention core, the T^2 part)")
    prefetch: bool = opt(True, "ZeRO-3: gather the next block's parameters while the current one computes")
    offload: str = opt("none", "where the optimizer's master weights and Adam state live: none (with the model) | cpu "
                       "(host memory) | disk (memory-mapped files under --train.offload_dir, paged in as the step "
                       "reaches them)")
    offload_chunk_mb: float = opt(4.0, "offloaded: MiB of the master the optimizer steps at a time; with disk, each "
                                  "chunk's pages go back to the kernel once stepped, so the process holds one "
                                  "chunk of master, m and v, not all of it")
    offload_dir: str = opt("", "disk offload's directory (default OUT/offload; given, the run writes in a directory "
                           "of its own under it, named after OUT); this rank's files are made fresh and "
                           "removed at the end")
    memory_profile: bool = opt(False, "print per-rank memory (at rest and peak, measured and predicted) at the "
                               "end and write OUT/memory.json")
    max_skipped_steps: int = opt(3, "a step whose gradients hold NaN/Inf is skipped (parameters unchanged); "
                                 "this many in a row abort the run")
    spike_factor: float = opt(2.0, "a step whose loss exceeds this many times the mean of the previous "
                              "spike_window losses rolls the run back to the last checkpoint before it; 0 = off")
    spike_window: int = opt(10, "losses in the running mean the spike check compares against (checking starts "
                            "once the window is full)")
    log_every: int = opt(1, "print a progress line every this many steps (rank 0); 0 = quiet")
    straggler_factor: float = opt(1.5, "the final summary names the rank whose median busy time per step exceeds "
                                  "the other ranks' median by this factor (a straggler); 0 = off")
    profile_steps: str = opt("", "A:B writes a torch.profiler trace of steps A to B (1-based, inclusive) per rank to "
                             "OUT/profile: Chrome/Perfetto JSON, a directory TensorBoard's profile plugin reads")
    compile: bool = opt(False, "torch.compile each transformer block (after activation checkpointing, before the "
                        "strategy's hooks); the first steps are slow while it compiles")
    late_stats: str = opt("auto", "on | off | auto: read each step's statistics (loss, norms, what the ranks "
                          "agree on) while the next step runs, so the host never waits for the device between "
                          "steps; a step's line is then printed and acted on (evaluation and saves excepted, which "
                          "wait for their step) one step later. auto: on a GPU, where it applies (not with "
                          "fp16's loss scaler or a pipeline)")


@dataclass
class EvalConfig:
    every: int = opt(0, "compute the loss on the corpus's held-out split every N steps and after the last; 0 = never")
    batches: int = opt(8, "batches in each evaluation, each of train.batch_size examples per data-parallel rank "
                       "(every rank a disjoint part; the same examples every time, so the figures compare; capped "
                       "at what the held-out split holds)")


@dataclass
class LogConfig:
    """Where step metrics go besides OUT/metrics.jsonl (rank 0 writes; each sink's package is imported only
    when it is switched on)."""

    tensorboard: bool = opt(False, "write TensorBoard event files to OUT/tensorboard (needs the tensorboard package)")
    wandb: bool = opt(False, "log to Weights & Biases (needs the wandb package; WANDB_MODE=offline works offline)")
    mlflow: bool = opt(False, "log to MLflow (needs the mlflow package; MLFLOW_TRACKING_URI, else OUT/mlruns)")
    project: str = opt("minitrain", "W&B project / MLflow experiment name")
    run_name: str = opt("", "the run's name in W&B / MLflow; '' = the name of the --out directory")


def check_batch(cfg: RunConfig) -> None:
    t = cfg.train
    for name in ("steps", "batch_size", "grad_accum"):
        require_positive(f"train.{name}", getattr(t, name))
    if cfg.dist.nproc < 1:
        raise ConfigError(f"world size must be at least 1 (got --nproc {cfg.dist.nproc})")
    _derive_batch_size(cfg)
    if not 0 <= t.stop_at <= t.steps:
        raise ConfigError(f"--stop-at {t.stop_at} must be between 0 (off) and --steps {t.steps}")


def _derive_batch_size(cfg: RunConfig) -> None:
    """With train.global_batch set, each rank's batch_size follows from it and this world's data-parallel
    degree. Rank r of d then reads examples r, r+d, ... of each global batch (data.ShardedLoader): the same
    examples in the same steps at any d, so the mean gradient is the same sum in another order (float64 runs
    of different sizes agree to rounding)."""
    t, d = cfg.train, cfg.dist
    if t.global_batch < 0:
        raise ConfigError(f"train.global_batch must be >= 0 (0 = off), got {t.global_batch}")
    if not t.global_batch or d.tp < 1 or d.pp < 1 or d.cp < 1 or d.nproc % (d.tp * d.pp * d.cp):
        return  # the layout's own check names a world that does not divide
    dp = d.nproc // (d.tp * d.pp * d.cp)
    if t.global_batch % (dp * t.grad_accum):
        raise ConfigError(f"--global-batch {t.global_batch} is not divisible by {dp} data-parallel rank(s) x "
                          f"--grad-accum {t.grad_accum}; pick a multiple of every world size the run may have")
    t.batch_size = t.global_batch // (dp * t.grad_accum)


def check_precision(t: TrainConfig) -> None:
    require_choice("train.dtype", t.dtype, ("float32", "float64"))
    require_choice("train.precision", t.precision, ("fp32", "bf16", "fp16"))
    require_choice("train.reduce_dtype", t.reduce_dtype, ("fp32", "compute"))
    if t.precision != "fp32" and t.dtype != "float32":
        raise ConfigError(f"--precision {t.precision} keeps float32 master weights; use --dtype float32 "
                          f"(float64 is for exact parity checks in full precision)")
    if not t.loss_scale_init > 0:
        raise ConfigError(f"train.loss_scale_init must be > 0, got {t.loss_scale_init}")
    require_positive("train.loss_scale_window", t.loss_scale_window)
    require_choice("train.activation_checkpointing", t.activation_checkpointing, ("none", "block", "selective"))
    require_choice("train.offload", t.offload, ("none", "cpu", "disk"))
    if not t.offload_chunk_mb > 0:
        raise ConfigError(f"train.offload_chunk_mb must be > 0, got {t.offload_chunk_mb}")


def check_optimizer(t: TrainConfig) -> None:
    if not t.lr > 0:
        raise ConfigError(f"train.lr must be > 0, got {t.lr}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must lie in [0, 1], got {t.min_lr_ratio}")
    for name in ("warmup_steps", "weight_decay", "grad_clip", "log_every", "max_skipped_steps"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {getattr(t, name)}")
    if not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1) or t.eps <= 0:
        raise ConfigError("Adam needs 0 <= beta1, beta2 < 1 and eps > 0")


def check_guards(t: TrainConfig) -> None:
    """The checks that watch a run's steps: the loss-spike rollback and the straggler report."""
    if t.spike_factor and not t.spike_factor > 1:
        raise ConfigError(f"train.spike_factor must be > 1 (or 0 to turn the check off), got {t.spike_factor}")
    require_positive("train.spike_window", t.spike_window)
    if t.straggler_factor and not t.straggler_factor > 1:
        raise ConfigError(f"train.straggler_factor must be > 1 (or 0 to turn it off), got {t.straggler_factor}")


def check_eval(e: EvalConfig) -> None:
    require_non_negative("eval.every", e.every)
    require_positive("eval.batches", e.batches)


def profile_range(text: str, steps: int) -> tuple[int, int] | None:
    """--train.profile_steps 'A:B' as (A, B), or None when empty; ConfigError unless 1 <= A <= B <= steps."""
    if not text:
        return None
    first, sep, last = text.partition(":")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()):
        raise ConfigError(f"train.profile_steps must look like A:B (e.g. 5:7), got {text!r}")
    a, b = int(first), int(last)
    if not 1 <= a <= b <= steps:
        raise ConfigError(f"train.profile_steps {text!r} must satisfy 1 <= A <= B <= train.steps ({steps})")
    return a, b
