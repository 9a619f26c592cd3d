"""The independent reference the parity tests compare against: plain PyTorch, one process.

None of minitrain's training machinery takes part. The model is an unwrapped MiniGPT (the model
definition is what gets trained, not what is under test); the optimizer is `torch.optim.AdamW`;
clipping is `torch.nn.utils.clip_grad_norm_`; the learning-rate schedule, the data order and the
fp16 loss scaling are written out below from their documented definitions; the loss is the mean
token cross-entropy over the whole global batch at once (no ranks, no micro-batches).

So a bug shared by minitrain's trainer and its strategies (the schedule, clipping, loss averaging,
accumulation, the data order, unscaling) makes the parity tests fail instead of cancelling out,
as it would when one minitrain run is compared with another.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from minitrain.config import RunConfig
from minitrain.data import load_corpus
from minitrain.models.minigpt.model import MiniGPT


def learning_rate(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """0-based step -> LR: linear warmup over `warmup` steps to `lr`, then half a cosine down to
    lr * min_ratio, reached at the last step (`total` - 1)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    floor = lr * min_ratio
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return floor + (lr - floor) * (1 + math.cos(math.pi * progress)) / 2


def step_examples(num_examples: int, micro_global: int, micro_per_step: int, seed: int, step: int) -> np.ndarray:
    """Example ids of optimizer step `step`: global micro-batches of `micro_global` examples taken in
    order from each epoch's permutation (drawn from [seed, epoch]); a partial batch left at the end of
    an epoch is skipped."""
    per_epoch = num_examples // micro_global
    ids = []
    for micro in range(step * micro_per_step, (step + 1) * micro_per_step):
        epoch, index = divmod(micro, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        ids.append(order[index * micro_global:(index + 1) * micro_global])
    return np.concatenate(ids)


@dataclass
class ReferenceRun:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # global norm of the unscaled gradient, before clipping
    param_norms: list[float] = field(default_factory=list)  # after each step
    lrs: list[float] = field(default_factory=list)
    # A mixture of experts: the router's auxiliary losses per step (the mean over its forwards, as StepRecord's)
    router_losses: list[float] = field(default_factory=list)
    clipped: list[bool] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)  # fp16: the scaled gradient overflowed
    scales: list[float] = field(default_factory=list)  # fp16: the loss scale each step used
    initial_params: torch.Tensor | None = None  # every parameter before the first step, same order
    params: torch.Tensor | None = None  # every parameter, flattened in registration order
    grads: torch.Tensor | None = None  # the last step's unscaled, unclipped gradient, same order
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    names: list[tuple[str, torch.Size]] = field(default_factory=list)  # (name, shape) in the flat order

    def by_name(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """One of the flat vectors above, cut back into the model's named parameters."""
        sizes = [shape.numel() for _, shape in self.names]
        return {name: part.view(shape) for (name, shape), part in zip(self.names, flat.split(sizes))}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def plain_run(cfg: RunConfig, steps: int | None = None, loss_scale: float | None = None,
              scale_window: int = 1000, never_seen: frozenset[int] = frozenset()) -> ReferenceRun:
    """Train `cfg`'s model and data in one process for `steps` steps (default cfg.train.steps) with the
    global batch cfg.train.batch_size * grad_accum * data-parallel ranks, in cfg.train.dtype.
    loss_scale: backward on loss * scale, gradients divided by it before anything reads them; an
    overflow skips the step and halves the scale, `scale_window` clean steps double it.
    never_seen: steps whose batch is drawn and dropped unseen (a bad batch a skipped step discards): nothing
    is computed from it, the optimizer does not count it, and the learning-rate schedule moves on past it;
    the per-step lists leave it out."""
    t, d = cfg.train, cfg.dist
    dtype = getattr(torch, t.dtype)
    torch.manual_seed(t.seed)
    model = MiniGPT(cfg.model).to(dtype)
    params = list(model.parameters())  # a tied weight appears once
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
    tokens = torch.from_numpy(np.asarray(load_corpus(cfg), dtype=np.int64))
    seq = cfg.model.seq_len
    data_parallel = d.nproc // (d.tp * d.pp * d.cp)  # a context-parallel group splits its sequences
    num_examples = (len(tokens) - 1) // seq
    out, clean = ReferenceRun(initial_params=_flat(params).clone()), 0
    for step in range(t.steps if steps is None else steps):
        if step in never_seen:
            continue
        ids = torch.from_numpy(step_examples(num_examples, t.batch_size * data_parallel, t.grad_accum, t.seed, step))
        window = tokens[ids[:, None] * seq + torch.arange(seq + 1)]
        loss, aux = _loss_and_aux(model, window, t.batch_size * data_parallel, data_parallel, cfg.model.moe_experts,
                                  cfg.model.moe_balance)
        optimizer.zero_grad()
        ((loss + aux) * loss_scale if loss_scale else loss + aux).backward()
        if loss_scale:
            for p in params:
                p.grad.div_(loss_scale)
        lr = learning_rate(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        grads = _flat(p.grad for p in params)
        norm = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else math.inf,
                                                    foreach=False))
        out.losses.append(loss.item())
        if cfg.model.moe_experts:
            out.router_losses.append(float(aux.detach()))
        out.grad_norms.append(norm)
        out.lrs.append(lr)
        out.clipped.append(0 < t.grad_clip < norm)
        out.scales.append(loss_scale)
        out.skipped.append(not math.isfinite(norm))
        if out.skipped[-1]:  # only with loss scaling: the scale was too large
            loss_scale, clean = loss_scale / 2, 0
        else:
            out.grads = grads
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            if loss_scale:
                clean += 1
                if clean == scale_window:
                    loss_scale, clean = loss_scale * 2, 0
        out.param_norms.append(float(_flat(params).norm()))
    out.names = [(name, p.shape) for name, p in model.named_parameters()]
    out.params = _flat(params)
    out.exp_avg = _flat(optimizer.state[p]["exp_avg"] for p in params)
    out.exp_avg_sq = _flat(optimizer.state[p]["exp_avg_sq"] for p in params)
    return out


def _loss_and_aux(model, window: torch.Tensor, micro_global: int, data_parallel: int, experts: int,
                  balance: str = "global"):
    """(the mean token cross-entropy, the auxiliary losses) of a step's examples. A dense model takes the whole
    batch at once. A mixture of experts' load-balancing loss depends on which tokens are routed together: under
    moe_balance "global" all of a micro-batch's, one forward each; under "rank" each rank's share of each
    micro-batch (position p of a micro-batch goes to rank p % ranks, data.py) is a forward of its own, as the
    ranks compute it. The losses are the mean over those forwards."""
    if not experts:
        logits = model(window[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1)), 0.0
    micros = window.split(micro_global)
    shares = list(micros) if balance == "global" else \
        [micro[r::data_parallel] for micro in micros for r in range(data_parallel)]
    loss, aux = 0.0, 0.0
    for share in shares:
        logits = model(share[:, :-1])
        loss = loss + F.cross_entropy(logits.reshape(-1, logits.size(-1)), share[:, 1:].reshape(-1)) / len(shares)
        aux = aux + sum(m.aux_loss for m in model.moe_layers()) / len(shares)
    return loss, aux


def worst_differences(ref: ReferenceRun, *, losses=None, grad_norms=None, param_norms=None, router_losses=None,
                      params=None) -> dict[str, float]:
    """The largest |ours - reference| of each quantity given (per-step lists, or the final flat parameters)."""
    out = {}
    for name, ours in (("losses", losses), ("grad_norms", grad_norms), ("param_norms", param_norms),
                       ("router_losses", router_losses)):
        if ours is not None:
            theirs = getattr(ref, name)
            assert len(ours) == len(theirs), f"{name}: {len(ours)} steps against the reference's {len(theirs)}"
            out[name] = max(abs(a - b) for a, b in zip(ours, theirs))
    if params is not None:
        out["params"] = (params - ref.params).abs().max().item()
    return out


def assert_close_to(ref: ReferenceRun, tol: float, what: str = "", **ours) -> None:
    """Every quantity given within `tol` of the plain PyTorch reference."""
    worst = worst_differences(ref, **ours)
    off = {k: v for k, v in worst.items() if not v <= tol}
    assert not off, f"{what}: off the plain PyTorch reference by " + ", ".join(f"{k} {v:.3g}" for k, v in off.items())


def assert_exercises_the_loop(ref: ReferenceRun) -> None:
    """A parity run proves little about clipping or the schedule unless both act: some steps clipped and
    some not, the learning rate taking several values, and the loss falling."""
    assert any(ref.clipped) and not all(ref.clipped), f"clipping on steps {ref.clipped}: choose grad_clip between norms"
    assert len(set(ref.lrs)) >= 3, f"the schedule barely moves: {ref.lrs}"
    assert ref.losses[-1] < ref.losses[0], "the reference did not train"
