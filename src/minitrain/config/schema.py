"""The run's settings: one dataclass per section, every field with its help text (what `minitrain train --help`
prints), the presets, and `RunConfig.validate()`, which checks what the settings say by themselves and raises
ConfigError with a sentence a user can act on. What needs more than the settings (the corpus on disk, an
installed tracking package) is checked by train/run_config.py. A leaf: imports nothing of minitrain but errors.

Longer than our ~400 lines on purpose: every setting with its help text and check in one file is the reference
a user reads next to `minitrain train --help`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field

from ..errors import ConfigError

# The deliberate failures train/faults.py knows (--fault.kind).
FAULT_KINDS = ("", "sigkill", "sigterm", "kill-in-save", "save-error", "lr-spike", "slow", "slow-turns",
               "truncate-offload")


def opt(default, help: str):
    """A config field with its help text (shown by --help)."""
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    preset: str = opt("tiny", "named starting point: " + "tiny | small | gpt2-124m; explicit model fields override it")
    n_layer: int = opt(2, "number of transformer blocks")
    d_model: int = opt(32, "width of the residual stream")
    n_head: int = opt(4, "attention heads; must divide d_model")
    vocab_size: int = opt(64, "token vocabulary; must cover the corpus. With --corpus text or a prepared directory "
                          "it is taken from the corpus unless given here")
    seq_len: int = opt(16, "context length in tokens, also the length of every training example")
    d_ff: int = opt(0, "hidden width of the MLP; 0 means 4 * d_model")
    tie_weights: bool = opt(False, "share the token embedding with the LM head")
    attention: str = opt("sdpa", "sdpa (PyTorch's fused scaled_dot_product_attention: flash attention where "
                         "available) | explicit (the scores, mask and softmax spelled out: for teaching)")
    moe_experts: int = opt(0, "mixture of experts: this many expert MLPs per block, a router picking moe_top_k "
                           "of them for each token (0: one dense MLP)")
    moe_top_k: int = opt(2, "experts each token is sent to (their outputs weighted by the router's renormalised "
                         "probabilities)")
    moe_capacity_factor: float = opt(0.0, "0: dropless (every token reaches its experts); else each expert takes "
                                     "at most ceil(factor x tokens x top_k / experts) per forward, the first in "
                                     "token order, the rest dropped (counted)")
    moe_aux_loss_coef: float = opt(0.01, "weight of the load-balancing loss (Switch/GShard: experts x sum of "
                                   "token fraction x mean router probability; 1 when balanced)")
    moe_z_loss_coef: float = opt(0.0, "weight of the router z-loss (ST-MoE: mean squared log-sum-exp of the "
                                 "router logits), 0 to leave it out")

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16, d_ff=0, tie_weights=False),
    "small": dict(n_layer=4, d_model=256, n_head=8, vocab_size=256, seq_len=128, d_ff=0, tie_weights=False),
    # GPT-2 small; vocab padded from 50257 to a multiple of 64 as nanoGPT does.
    "gpt2-124m": dict(n_layer=12, d_model=768, n_head=12, vocab_size=50304, seq_len=1024, d_ff=0, tie_weights=True),
}


@dataclass
class DataConfig:
    corpus: str = opt("synthetic", "synthetic | text (the shipped byte-level prose) | a directory written by "
                      "`minitrain data prepare` (train.bin, val.bin, tokenizer.json, meta.json) | a nanoGPT-style "
                      "uint16 .bin token file (a val.bin beside it is its held-out split)")
    synthetic_tokens: int = opt(65536, "length of the synthetic corpus in tokens")
    corpus_seed: int = opt(0, "seed that generates the synthetic corpus (the data order uses train.seed)")
    prefetch: int = opt(2, "batches a background thread makes ahead while the step runs (pinned for a GPU's "
                        "asynchronous copy); the same batches in the same order; 0 = each made in the step")


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


@dataclass
class DDPConfig:
    mode: str = opt("bucketed", "how data parallel syncs gradients (with --zero 0): bucketed = ours, all-reduce "
                    "per bucket overlapped with backward; naive = one all-reduce per tensor after backward; "
                    "torch = PyTorch DistributedDataParallel, the reference")
    bucket_mb: float = opt(25.0, "gradient bucket size cap in MiB (bucketed and torch modes)")
    measure_sync: bool = opt(False, "bracket backward + gradient sync with barriers each step and record "
                             "the sync wall time (costs two barriers per step)")


@dataclass
class DistConfig:
    nproc: int = opt(1, "ranks to spawn on this machine (ignored under torchrun, which sets the world size)")
    backend: str = opt("auto", "auto | gloo | nccl; auto picks nccl when CUDA is available (a GPU per local rank, "
                               "or refused), else gloo")
    timeout_s: float = opt(300.0, "process-group timeout: a collective stuck this long fails instead of hanging")
    threads_per_rank: int = opt(1, "torch CPU threads per rank (1 avoids oversubscribing cores)")
    fingerprint_every: int = opt(100, "every this many steps the ranks compare, through the rendezvous store (a "
                                 "few round trips, no collective), a digest of every collective each issued so far "
                                 "(op, shapes, dtype, call site); a mismatch stops the run naming the ranks and the "
                                 "first collective that differ, before it can hang or silently compute garbage; "
                                 "0 = off")
    tp: int = opt(1, "tensor-parallel degree: each layer split across this many adjacent ranks (Megatron-style); "
                  "must divide the heads, the MLP width and the vocabulary; data parallel = world / (tp x pp)")
    pp: int = opt(1, "pipeline-parallel degree: the blocks split into this many contiguous stages, one per rank "
                  "of a pipeline group (embedding on the first, head and loss on the last)")
    ep: int = opt(1, "expert-parallel degree (a mixture of experts): groups of this many adjacent data-parallel "
                  "ranks each compute 1/ep of every layer's experts, tokens sent to them and back by all-to-all; "
                  "must divide the ranks and --model.moe_experts")
    microbatches: int = opt(1, "micro-batches each batch is cut into (they must divide --batch-size): the pipeline "
                            "keeps stages busy with different ones; the bubble is (pp-1)/(microbatches+pp-1)")
    schedule: str = opt("1f1b", "pipeline schedule: 1f1b (warm-up, one forward / one backward, cool-down: at most "
                        "pp micro-batches of activations held) | gpipe (all forwards, then all backwards: holds all)")


@dataclass
class CheckpointConfig:
    every_steps: int = opt(0, "save a sharded checkpoint every this many steps; 0 = never")
    every_minutes: float = opt(0.0, "also save when this many minutes have passed since the last save (rank 0's "
                               "clock decides for all ranks); 0 = off")
    keep_last: int = opt(0, "keep only the newest K complete checkpoints (older ones are deleted after a save); "
                         "0 = keep all")
    resume: str = opt("", "'' = start fresh, 'auto' = newest checkpoint under OUT (or --ckpt.dir) if any, or a "
                      "checkpoint path")
    dir: str = opt("", "where the checkpoints also go: object storage (s3://bucket/prefix, or any fsspec "
                   "location) or an absolute path of a filesystem every machine mounts; each checkpoint is uploaded "
                   "there once saved in OUT/checkpoints, committed when every "
                   "rank's files are there; --resume auto fetches a newer one from it (a node's disk lost). s3:// "
                   "needs s3fs and reads the AWS_* variables (AWS_ENDPOINT_URL for an S3-compatible server); "
                   "'' = OUT/checkpoints only")
    async_save: bool = opt(False, "write checkpoint files in a background thread from a CPU snapshot while training "
                           "goes on; `latest` moves only once every rank's file is durable")
    final_save: bool = opt(True, "save a checkpoint after the last step, so every run leaves a model to export "
                           "(--no-final-save turns it off)")


@dataclass
class FaultConfig:
    """Deliberate failures for testing fault tolerance (see minitrain/faults.py)."""

    kind: str = opt("", "'' = none | sigkill | sigterm | kill-in-save | save-error | lr-spike | slow | "
                    "slow-turns | truncate-offload; fires once (slow: every step from fault.step; slow-turns: the "
                    "ranks take turns sleeping, rank r of n at steps r, r + n, r + 2n, ...), never in a resumed run")
    step: int = opt(0, "the step at which the fault fires")
    rank: int = opt(0, "the rank it fires on (lr-spike applies on every rank)")
    lr_multiplier: float = opt(100.0, "lr-spike: that step's learning rate is multiplied by this")
    slow_s: float = opt(0.1, "slow: seconds the rank sleeps at the start of each step")


@dataclass
class ParameterServerConfig:
    """Parameter-server training (parallel/param_server.py): the last S ranks hold the parameters and optimizer
    state, the others compute gradients."""

    servers: int = opt(0, "ranks that are parameter servers, each holding a contiguous shard of the parameters and "
                       "its optimizer state; the other ranks are workers that push gradients and pull parameters "
                       "(0 = no parameter servers: data parallel or ZeRO)")
    staleness: int = opt(0, "K: a worker may run up to K steps ahead of the slowest worker (stale-synchronous "
                         "parallel), computing on parameters that miss at most the K latest updates; 0 = "
                         "synchronous, equal to data parallel over the workers")
    elastic: bool = opt(False, "a worker (other than worker 0, which speaks for the run) that dies is left out: the "
                        "servers complete every later update with the other workers' gradients and the run goes on, "
                        "its data shard skipped; needs --ps.staleness 1 or more and --nproc (torchrun's agent ends "
                        "every rank when one fails)")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    ps: ParameterServerConfig = field(default_factory=ParameterServerConfig)
    out: str = opt("runs/train", "directory for everything the run writes: metrics.jsonl, checkpoints/")

    def validate(self) -> "RunConfig":
        """Every setting checked by what it says alone (the batch derived from --global-batch on the way);
        ConfigError names the first that is wrong."""
        _check_finite(self)
        check_model(self.model)
        _check_batch(self)
        _check_sync(self)
        _check_precision(self.train)
        _check_optimizer(self.train)
        _check_distributed(self)
        _check_run(self)
        _check_parameter_servers(self)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def data_parallel_ranks(self) -> int:
        """The ranks that each read their own share of a batch: the world / (tp x pp), less parameter servers."""
        d = self.dist
        return (d.nproc - self.ps.servers) // (d.tp * d.pp)


def _check_finite(cfg: RunConfig) -> None:
    for key, kind, _, _ in field_specs():  # NaN passes every comparison below; inf overflows later
        value = _get(cfg, key)
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")


def _check_batch(cfg: RunConfig) -> None:
    t = cfg.train
    for name in ("steps", "batch_size", "grad_accum"):
        _require_positive(f"train.{name}", getattr(t, name))
    if cfg.dist.nproc < 1:
        raise ConfigError(f"world size must be at least 1 (got --nproc {cfg.dist.nproc})")
    _derive_batch_size(cfg)
    if not 0 <= t.stop_at <= t.steps:
        raise ConfigError(f"--stop-at {t.stop_at} must be between 0 (off) and --steps {t.steps}")


def _check_sync(cfg: RunConfig) -> None:
    t, ddp = cfg.train, cfg.ddp
    _require_choice("train.zero", t.zero, (0, 1, 2, 3))
    _require_choice("ddp.mode", ddp.mode, ("bucketed", "naive", "torch"))
    if t.zero and ddp.mode != "bucketed":
        raise ConfigError(f"--dp {ddp.mode} applies to --zero 0; ZeRO-{t.zero} syncs gradients with its "
                          "own reduce-scatter")
    if not ddp.bucket_mb > 0:
        raise ConfigError(f"ddp.bucket_mb must be > 0, got {ddp.bucket_mb}")
    _require_choice("train.late_stats", t.late_stats, ("auto", "on", "off"))
    if t.late_stats == "on" and (t.precision == "fp16" or cfg.dist.pp > 1 or cfg.dist.microbatches > 1):
        raise ConfigError("--train.late_stats on: fp16 (its loss scale) and pipelines need each step's statistics "
                          "before the next step; use auto or off")


def _check_precision(t: TrainConfig) -> None:
    _require_choice("train.dtype", t.dtype, ("float32", "float64"))
    _require_choice("train.precision", t.precision, ("fp32", "bf16", "fp16"))
    _require_choice("train.reduce_dtype", t.reduce_dtype, ("fp32", "compute"))
    if t.precision != "fp32" and t.dtype != "float32":
        raise ConfigError(f"--precision {t.precision} keeps float32 master weights; use --dtype float32 "
                          f"(float64 is for exact parity checks in full precision)")
    if not t.loss_scale_init > 0:
        raise ConfigError(f"train.loss_scale_init must be > 0, got {t.loss_scale_init}")
    _require_positive("train.loss_scale_window", t.loss_scale_window)
    _require_choice("train.activation_checkpointing", t.activation_checkpointing, ("none", "block", "selective"))
    _require_choice("train.offload", t.offload, ("none", "cpu", "disk"))
    if not t.offload_chunk_mb > 0:
        raise ConfigError(f"train.offload_chunk_mb must be > 0, got {t.offload_chunk_mb}")


def _check_optimizer(t: TrainConfig) -> None:
    if not t.lr > 0:
        raise ConfigError(f"train.lr must be > 0, got {t.lr}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must lie in [0, 1], got {t.min_lr_ratio}")
    for name in ("warmup_steps", "weight_decay", "grad_clip", "log_every", "max_skipped_steps"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {getattr(t, name)}")
    if not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1) or t.eps <= 0:
        raise ConfigError("Adam needs 0 <= beta1, beta2 < 1 and eps > 0")


def _check_distributed(cfg: RunConfig) -> None:
    d = cfg.dist
    _require_choice("dist.backend", d.backend, ("auto", "gloo", "nccl"))
    _check_gpus(d)
    if not d.timeout_s > 0:
        raise ConfigError(f"dist.timeout_s must be > 0, got {d.timeout_s}")
    _require_positive("dist.threads_per_rank", d.threads_per_rank)
    _require_non_negative("dist.fingerprint_every", d.fingerprint_every)
    _check_layout(cfg)


def _check_run(cfg: RunConfig) -> None:
    """What the run writes and watches: profiling, checkpoints, guards, faults, seeds, --out, evaluation."""
    t = cfg.train
    profile_range(t.profile_steps, t.steps)
    for name in ("every_steps", "every_minutes", "keep_last"):
        if getattr(cfg.ckpt, name) < 0:
            raise ConfigError(f"ckpt.{name} must be >= 0, got {getattr(cfg.ckpt, name)}")
    _check_store(cfg.ckpt.dir, cfg.out)
    if t.spike_factor and not t.spike_factor > 1:
        raise ConfigError(f"train.spike_factor must be > 1 (or 0 to turn the check off), got {t.spike_factor}")
    _require_positive("train.spike_window", t.spike_window)
    if t.straggler_factor and not t.straggler_factor > 1:
        raise ConfigError(f"train.straggler_factor must be > 1 (or 0 to turn it off), got {t.straggler_factor}")
    _check_fault(cfg.fault, cfg.dist.nproc)
    check_seed("--seed", t.seed)
    check_seed("--data.corpus_seed", cfg.data.corpus_seed)
    _require_non_negative("data.prefetch", cfg.data.prefetch)
    if not cfg.out.strip():
        raise ConfigError("--out is empty; name the directory the run writes to (e.g. --out runs/mine)")
    _require_non_negative("eval.every", cfg.eval.every)
    _require_positive("eval.batches", cfg.eval.batches)


def _check_store(location: str, out: str) -> None:
    """--ckpt.dir: a URL, or an absolute path of a filesystem every machine mounts, apart from OUT."""
    if not location or ("://" in location and not location.startswith("file://")):
        return
    path = location.removeprefix("file://")
    if not os.path.isabs(path):
        raise ConfigError(f"--ckpt.dir {location}: give an absolute path (a filesystem every machine mounts) or a URL "
                          "of object storage (s3://bucket/prefix)")
    store, run = os.path.realpath(path), os.path.realpath(out)
    if os.path.commonpath([store, run]) in (store, run):
        raise ConfigError(f"--ckpt.dir {location} and --out {out} overlap; the store keeps checkpoints apart from "
                          "the run's OUT/checkpoints: give a directory outside OUT")


def _check_parameter_servers(cfg: RunConfig) -> None:
    """What parameter servers combine with so far (the world's size is checked again by the ranks, which know it
    under torchrun)."""
    ps, d, t = cfg.ps, cfg.dist, cfg.train
    _require_non_negative("ps.servers", ps.servers)
    _require_non_negative("ps.staleness", ps.staleness)
    if not ps.servers:
        if ps.staleness or ps.elastic:
            raise ConfigError(f"--ps.{'staleness' if ps.staleness else 'elastic'} needs parameter servers "
                              "(--ps.servers S)")
        return
    if ps.elastic and not ps.staleness:
        raise ConfigError("--ps.elastic needs --ps.staleness 1 or more: at K = 0 the workers exchange every step's "
                          "statistics, which a worker that died would hold up")
    if ps.elastic and "WORLD_SIZE" in os.environ:
        raise ConfigError("--ps.elastic needs --nproc: under torchrun its agent ends every rank when one fails")
    if ps.servers >= d.nproc and "WORLD_SIZE" not in os.environ:
        raise ConfigError(f"--ps.servers {ps.servers} leaves no worker among --nproc {d.nproc} ranks; give fewer "
                          "servers or more ranks")
    clashes = [name for name, on in (("--tp", d.tp > 1), ("--pp", d.pp > 1), ("--dist.ep", d.ep > 1),
                                     ("--zero", t.zero > 0), ("--dist.microbatches", d.microbatches > 1),
                                     ("--precision fp16", t.precision == "fp16"), ("--backend nccl",
                                     d.backend == "nccl"), ("--train.offload", t.offload != "none"),
                                     ("--global-batch", t.global_batch > 0)) if on]
    if clashes:
        raise ConfigError(f"--ps.servers trains the workers' whole model with its optimizer on the servers, over gloo; "
                          f"it does not combine with {', '.join(clashes)}")
    saves = [name for name, on in (("--ckpt.every_minutes", cfg.ckpt.every_minutes), ("--ckpt.dir", cfg.ckpt.dir),
                                   ("--ckpt.async_save", cfg.ckpt.async_save)) if on]
    if saves:
        raise ConfigError(f"a parameter-server run saves synchronously into OUT, every so many steps; drop "
                          f"{', '.join(saves)}")
    if ps.staleness and (cfg.ckpt.every_steps or cfg.ckpt.resume):
        raise ConfigError("checkpoints during a parameter-server run (--ckpt.every_steps, --ckpt.resume) need "
                          "--ps.staleness 0 for now: under K > 0 each worker would decide a rollback on its own "
                          "losses (the final save is kept)")
    if ps.staleness and t.memory_profile:
        raise ConfigError("--train.memory_profile with --ps.staleness > 0: its report gathers every worker at the end, "
                          "where a worker that stopped early is no longer waiting; profile at K = 0")
    if ps.staleness and cfg.eval.every:
        raise ConfigError("--eval.every with --ps.staleness > 0: workers at different steps hold different "
                          "parameters, so there is no one model to evaluate at a step; evaluate at K = 0")


def check_model(m: ModelConfig) -> None:
    """ConfigError unless the model's settings build a MiniGPT (also for an exported model's config.json)."""
    if m.preset not in PRESETS:
        raise ConfigError(f"unknown preset '{m.preset}'; choose one of: {', '.join(PRESETS)}")
    for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
        value = getattr(m, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"model.{name} must be an integer, got {value!r}")
        _require_positive(f"model.{name}", value)
    if m.d_model % m.n_head:
        raise ConfigError(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}; "
                          "pick a head count that divides the width")
    if not isinstance(m.d_ff, int) or m.d_ff < 0:
        raise ConfigError(f"model.d_ff must be >= 0 (0 means 4 * d_model), got {m.d_ff}")
    _require_choice("model.attention", m.attention, ("sdpa", "explicit"))
    _check_experts(m)


def _check_experts(m: ModelConfig) -> None:
    for name in ("moe_experts", "moe_top_k"):
        value = getattr(m, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"model.{name} must be an integer >= 0, got {value!r}")
    if not m.moe_experts:
        return
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must lie in [1, model.moe_experts={m.moe_experts}]: "
                          "each token goes to that many different experts")
    if m.moe_capacity_factor < 0:
        raise ConfigError(f"model.moe_capacity_factor must be >= 0 (0: dropless), got {m.moe_capacity_factor}")
    for name in ("moe_aux_loss_coef", "moe_z_loss_coef"):
        if getattr(m, name) < 0:
            raise ConfigError(f"model.{name} must be >= 0, got {getattr(m, name)}")


def _check_gpus(d: DistConfig) -> None:
    """NCCL (asked for, or picked by auto on a machine with a GPU) needs one CUDA device per local rank: a node
    with fewer is refused, not run on gloo behind the user's back."""
    if d.backend == "gloo":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if d.backend == "auto" and gpus == 0:
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", d.nproc))
    if gpus < local_ranks:
        how = "--backend nccl" if d.backend == "nccl" else "--backend auto picks NCCL on a machine with a GPU, and"
        raise ConfigError(f"{how} needs a CUDA device per rank: {local_ranks} local ranks, "
                          f"{gpus} GPU(s) visible; use --backend gloo or fewer ranks")


def _derive_batch_size(cfg: RunConfig) -> None:
    """With train.global_batch set, each rank's batch_size follows from it and this world's data-parallel
    degree. Rank r of d then reads examples r, r+d, ... of each global batch (data.ShardedLoader): the same
    examples in the same steps at any d, so the mean gradient is the same sum in another order (float64 runs
    of different sizes agree to ~1e-15)."""
    t, d = cfg.train, cfg.dist
    if t.global_batch < 0:
        raise ConfigError(f"train.global_batch must be >= 0 (0 = off), got {t.global_batch}")
    if not t.global_batch or d.tp < 1 or d.pp < 1 or d.nproc % (d.tp * d.pp):
        return  # the layout's own check names a world that does not divide
    dp = d.nproc // (d.tp * d.pp)
    if t.global_batch % (dp * t.grad_accum):
        raise ConfigError(f"--global-batch {t.global_batch} is not divisible by {dp} data-parallel rank(s) x "
                          f"--grad-accum {t.grad_accum}; pick a multiple of every world size the run may have")
    t.batch_size = t.global_batch // (dp * t.grad_accum)


def _check_layout(cfg: RunConfig) -> None:
    """Every degree of the dp x tp x pp layout, with a message naming the ones that clash."""
    d, m = cfg.dist, cfg.model
    _require_positive("dist.tp", d.tp)
    _require_positive("dist.pp", d.pp)
    if d.nproc % (d.tp * d.pp):
        raise ConfigError(f"world size {d.nproc} is not divisible by --tp {d.tp} x --pp {d.pp}; the data-parallel "
                          "degree is world / (tp x pp), so pick degrees whose product divides the number of ranks")
    _require_positive("dist.ep", d.ep)
    if d.ep > 1:
        if not m.moe_experts:
            raise ConfigError(f"--dist.ep {d.ep} splits a mixture of experts' experts over ranks; this model is dense "
                              "(give --model.moe_experts)")
        if m.moe_experts % d.ep or d.nproc % d.ep:
            raise ConfigError(f"--dist.ep {d.ep} must divide --model.moe_experts ({m.moe_experts}) and the number of "
                              f"ranks ({d.nproc}): each rank of a group computes the same number of experts")
    if m.moe_experts and (d.tp > 1 or d.pp > 1):
        raise ConfigError(f"--model.moe_experts {m.moe_experts} with --tp {d.tp} --pp {d.pp}: a mixture of experts "
                          "trains with data parallelism and ZeRO for now (its experts are not split by tensor "
                          "parallelism, and a pipeline stage does not yet carry the load-balancing loss)")
    if d.tp > 1:
        for name, value in (("model.n_head", m.n_head), ("the MLP width (model.d_ff, 0 = 4 x d_model)", m.ffn_dim),
                            ("model.vocab_size", m.vocab_size)):
            if value % d.tp:
                padded = -(-value // d.tp) * d.tp
                hint = f" (e.g. --model.vocab_size {padded}: unused rows cost nothing)" if "vocab" in name else ""
                raise ConfigError(f"--tp {d.tp} does not divide {name} = {value}; tensor parallelism splits it "
                                  f"evenly across ranks{hint}")
    _require_positive("dist.microbatches", d.microbatches)
    _require_choice("dist.schedule", d.schedule, ("1f1b", "gpipe"))
    if cfg.train.batch_size % d.microbatches:
        raise ConfigError(f"--microbatches {d.microbatches} does not divide --batch-size {cfg.train.batch_size}; "
                          "each micro-batch is an equal slice of the batch")
    if cfg.ddp.mode == "torch" and (d.pp > 1 or d.microbatches > 1):
        raise ConfigError(f"--dp torch with --pp {d.pp} --microbatches {d.microbatches}: PyTorch's DDP decides in "
                          "forward whether backward syncs, so it cannot run a pipeline schedule's micro-batches; "
                          "use --dp bucketed (or --grad-accum for micro-batches without a pipeline)")
    if d.pp > 1:
        if m.n_layer < d.pp:
            raise ConfigError(f"--pp {d.pp} needs at least one block per stage; the model has {m.n_layer} "
                              f"(model.n_layer)")
        if m.tie_weights:
            raise ConfigError(f"--pp {d.pp} with model.tie_weights: the embedding (first stage) and the head (last "
                              "stage) cannot share a weight across stages yet; use --model.tie_weights false")


def _check_fault(f: FaultConfig, nproc: int) -> None:
    _require_choice("fault.kind", f.kind, FAULT_KINDS)
    if f.kind:
        _require_positive("fault.step", f.step)
        if not f.slow_s >= 0:
            raise ConfigError(f"fault.slow_s must be >= 0, got {f.slow_s}")
        if not 0 <= f.rank < nproc:
            raise ConfigError(f"fault.rank {f.rank} is not a rank of this run (world size {nproc})")


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


def _require_non_negative(name: str, value) -> None:
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")


SEED_LIMIT = 2 ** 63  # numpy's and torch's generators take seeds in [0, 2^63) everywhere


def check_seed(flag: str, value) -> None:
    """A seed every generator of the run accepts: 0 <= seed < 2^63 (ConfigError, one line, before anything runs)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"{flag} must be an integer in [0, 2^63), got {value}")


def _require_positive(name: str, value) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")


def _require_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig) if f.name != "out"}


def field_specs() -> list[tuple[str, type, object, str]]:
    """(dotted key, type, default, help) for every settable field, in declaration order."""
    specs = []
    for section in dataclasses.fields(RunConfig):
        if section.name == "out":
            specs.append(("out", str, section.default, section.metadata["help"]))
            continue
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            specs.append((f"{section.name}.{f.name}", hints[f.name], f.default, f.metadata["help"]))
    return specs


def _get(cfg: RunConfig, key: str):
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)
