"""A step's record: one line of metrics.jsonl (step_statistics.py reads it from the step's exchange)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepRecord:
    """One line of metrics.jsonl. Per-rank lists are indexed by rank."""

    step: int
    loss: float
    grad_norm: float
    # The global parameter norm and each rank's: on the steps the statistics' schedule computes it (every step for a
    # Trainer made without one; `minitrain train`: the steps that print a progress line, and the last), else None.
    param_norm: float | None
    lr: float
    tokens: int
    tokens_seen: int
    step_time_s: float
    tokens_per_s: float
    comm_time_s: float
    comm_bytes: int
    comm_calls: int
    param_norm_per_rank: list[float] | None
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
    # ...and the router's auxiliary losses (balancing and z-loss, coefficients applied: what they add to the
    # gradient's loss), summed over the layers, the mean over micro-batches and ranks; None for a dense model.
    router_loss: float | None = None
