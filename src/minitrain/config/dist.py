"""The sections of how ranks work together: ddp (how data parallel syncs gradients) and dist (the world, its
backend and the dp x tp x pp x ep layout), with the checks that the layout divides the model and the world."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .fields import opt, require_choice, require_non_negative, require_positive

if TYPE_CHECKING:  # the type only: schema.py puts the sections together and imports this module
    from .schema import RunConfig


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
    cp: int = opt(1, "context-parallel degree: groups of this many adjacent ranks split every sequence (each two "
                  "chunks of 2 x cp, one early and one late, so the causal work is even) and hold the same "
                  "parameters; attention sees the whole sequence by --dist.cp_style; the sequence length must "
                  "divide by 2 x cp; data parallel = world / cp")
    cp_style: str = opt("ring", "context-parallel attention: ring (keys and values passed round the group, online "
                        "softmax) | ulysses (all-to-all from a split of the tokens to a split of the heads; cp must "
                        "divide the heads)")
    microbatches: int = opt(1, "micro-batches each batch is cut into (they must divide --batch-size): the pipeline "
                            "keeps stages busy with different ones; the bubble is (pp-1)/(microbatches+pp-1)")
    virtual_stages: int = opt(1, "chunks of blocks per pipeline rank under --dist.schedule interleaved (2 or more; "
                              "pp x virtual_stages must divide the blocks): a micro-batch goes round the ranks that "
                              "many times and the bubble falls to (pp-1)/(V x microbatches + pp - 1)")
    schedule: str = opt("1f1b", "pipeline schedule: 1f1b (warm-up, one forward / one backward, cool-down: at most "
                        "pp micro-batches of activations held) | gpipe (all forwards, then all backwards: holds all) "
                        "| zero-bubble (ZB-H1: each backward split into the input's gradient and the weights', "
                        "which fill 1f1b's cool-down; about a third of its bubble) | interleaved (Megatron's virtual "
                        "pipeline: --dist.virtual_stages chunks per rank)")


def check_sync(cfg: RunConfig) -> None:
    t, ddp = cfg.train, cfg.ddp
    require_choice("train.zero", t.zero, (0, 1, 2, 3))
    require_choice("ddp.mode", ddp.mode, ("bucketed", "naive", "torch"))
    if t.zero and ddp.mode != "bucketed":
        raise ConfigError(f"--dp {ddp.mode} applies to --zero 0; ZeRO-{t.zero} syncs gradients with its "
                          "own reduce-scatter")
    if not ddp.bucket_mb > 0:
        raise ConfigError(f"ddp.bucket_mb must be > 0, got {ddp.bucket_mb}")
    require_choice("train.late_stats", t.late_stats, ("auto", "on", "off"))
    if t.late_stats == "on" and (t.precision == "fp16" or cfg.dist.pp > 1 or cfg.dist.microbatches > 1):
        raise ConfigError("--train.late_stats on: fp16 (its loss scale) and pipelines need each step's statistics "
                          "before the next step; use auto or off")


def check_distributed(cfg: RunConfig) -> None:
    d = cfg.dist
    require_choice("dist.backend", d.backend, ("auto", "gloo", "nccl"))
    _check_gpus(d)
    if not d.timeout_s > 0:
        raise ConfigError(f"dist.timeout_s must be > 0, got {d.timeout_s}")
    require_positive("dist.threads_per_rank", d.threads_per_rank)
    require_non_negative("dist.fingerprint_every", d.fingerprint_every)
    _check_layout(cfg)


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


def _check_layout(cfg: RunConfig) -> None:
    """Every degree of the dp x tp x pp layout, with a message naming the ones that clash."""
    d, m = cfg.dist, cfg.model
    require_positive("dist.tp", d.tp)
    require_positive("dist.pp", d.pp)
    if d.nproc % (d.tp * d.pp):
        raise ConfigError(f"world size {d.nproc} is not divisible by --tp {d.tp} x --pp {d.pp}; the data-parallel "
                          "degree is world / (tp x pp), so pick degrees whose product divides the number of ranks")
    require_positive("dist.ep", d.ep)
    if d.ep > 1:
        if not m.moe_experts:
            raise ConfigError(f"--dist.ep {d.ep} splits a mixture of experts' experts over ranks; this model is dense "
                              "(give --model.moe_experts)")
        if m.moe_experts % d.ep or d.nproc % d.ep:
            raise ConfigError(f"--dist.ep {d.ep} must divide --model.moe_experts ({m.moe_experts}) and the number of "
                              f"ranks ({d.nproc}): each rank of a group computes the same number of experts")
    _check_context(cfg)
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
    require_positive("dist.microbatches", d.microbatches)
    require_choice("dist.schedule", d.schedule, ("1f1b", "gpipe", "zero-bubble", "interleaved"))
    _check_interleaved(cfg)
    if d.schedule == "zero-bubble":
        clashes = [f for f, on in (("--tp", d.tp > 1), ("--train.activation_checkpointing",
                                                         cfg.train.activation_checkpointing != "none"),
                                   ("--train.compile", cfg.train.compile), (f"--zero {cfg.train.zero}",
                                                                             cfg.train.zero >= 2)) if on]
        if clashes:
            raise ConfigError(f"--dist.schedule zero-bubble with {', '.join(clashes)}: its weight gradients are "
                              "computed after the backward, from each layer's noted output, which those change "
                              "(a split layer's, a recomputed one's, a compiled block's, a gradient sharded as its "
                              "backward ends); use --dist.schedule 1f1b with them")
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


def _check_context(cfg: RunConfig) -> None:
    """Context parallelism's degree against the world, the sequence and the heads, and what it is not combined
    with (docs/context-parallel.md says why)."""
    d, m = cfg.dist, cfg.model
    require_positive("dist.cp", d.cp)
    require_choice("dist.cp_style", d.cp_style, ("ring", "ulysses"))
    if d.cp == 1:
        return
    if d.nproc % d.cp:
        raise ConfigError(f"--dist.cp {d.cp} does not divide the {d.nproc} ranks; data parallel = world / cp")
    clashes = [f for f, on in (("--tp", d.tp > 1), ("--pp", d.pp > 1), ("--dist.ep", d.ep > 1),
                               ("--model.moe_experts", m.moe_experts > 0),
                               ("--dist.microbatches", d.microbatches > 1)) if on]
    problem = context_problem(d.cp, d.cp_style, m.seq_len, m.n_head, clashes)
    if problem:
        raise ConfigError(problem)


def context_problem(cp: int, style: str, seq_len: int, heads: int, clashes: list[str],
                    flags: tuple[str, str, str] = ("--dist.cp", "--dist.cp_style", "--model.seq_len")) -> str | None:
    """What is wrong with context parallelism of degree cp for this sequence and these heads, beside the flags in
    `clashes` (the other parallelisms given), in one line naming the flags (`minitrain plan` has its own); None."""
    cp_flag, style_flag, seq_flag = flags
    if clashes:
        return (f"{cp_flag} {cp} with {', '.join(clashes)}: context parallelism composes with data parallelism and "
                "ZeRO only for now")
    if seq_len % (2 * cp):
        return (f"{cp_flag} {cp} cuts each sequence into 2 x cp = {2 * cp} equal chunks, and {seq_flag} {seq_len} "
                f"does not divide by {2 * cp}")
    if style == "ulysses" and heads % cp:
        return (f"{style_flag} ulysses splits the {heads} heads over {cp_flag} {cp} ranks, which does not divide "
                f"them; use {style_flag} ring, or a cp that divides the heads")
    return None


def _check_interleaved(cfg: RunConfig) -> None:
    """The interleaved schedule's virtual stages against the pipeline, the blocks and the micro-batches."""
    d, m = cfg.dist, cfg.model
    require_positive("dist.virtual_stages", d.virtual_stages)
    if (d.schedule == "interleaved") != (d.virtual_stages > 1):
        raise ConfigError(f"--dist.schedule {d.schedule} with --dist.virtual_stages {d.virtual_stages}: the "
                          "interleaved schedule and 2 or more virtual stages go together")
    if d.schedule != "interleaved":
        return
    if d.pp < 2 or m.n_layer % (d.pp * d.virtual_stages):
        raise ConfigError(f"--dist.schedule interleaved cuts the {m.n_layer} blocks into --pp {d.pp} x "
                          f"--dist.virtual_stages {d.virtual_stages} equal chunks: use --pp 2 or more and a number of "
                          "chunks that divides the blocks")
    if d.microbatches % d.pp:
        raise ConfigError(f"--dist.schedule interleaved runs micro-batches in groups of --pp {d.pp}: "
                          f"--microbatches {d.microbatches} must be a multiple of it")
    if d.tp > 1 or cfg.train.zero >= 2:
        raise ConfigError(f"--dist.schedule interleaved with --tp {d.tp} --zero {cfg.train.zero}: not combined yet "
                          "(ZeRO-2/3 gather and reduce each unit around the model's own forward and backward, which a "
                          "chunk's bypasses); use --dist.schedule 1f1b, or --zero 0 or 1")
