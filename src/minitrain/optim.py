"""AdamW on one flat vector of parameters, the LR schedule, and global-norm clipping.

The same `FlatAdamW` serves data parallel (the vector is every parameter) and
ZeRO (the vector is this rank's shard), so the strategies differ only in how
gradients arrive and parameters leave, which is what the parity tests check.
"""
from __future__ import annotations

import math

import torch

from .config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based optimizer step `step`: linear warmup to cfg.lr,
    then cosine decay to cfg.lr * cfg.min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """Factor that scales gradients to a global norm of at most max_norm (1.0 if off)."""
    if max_norm <= 0 or grad_norm <= max_norm:
        return 1.0
    return max_norm / (grad_norm + 1e-6)


def sum_of_squares(x: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """sum(x**2) accumulated in float64, chunk by chunk: an upcast copy of a large flat
    vector would cost 8 bytes per element at the peak of the step (and runs slower)."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for part in x.split(chunk):
        part = part.double()
        total += part.dot(part)
    return total


class FlatAdamW:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) over one flat vector.

    State: `master`, the parameters it updates (it takes ownership of the tensor
    passed in), plus exp_avg (m) and exp_avg_sq (v) of the same length and dtype: 12
    bytes per parameter in float32 (the ZeRO paper's K), also when the model computes in
    bf16/fp16. `decay_ranges` are the
    [start, stop) ranges of `master` that get weight decay (matrices and
    embeddings; biases and LayerNorm gains do not, as in GPT-2).
    """

    STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
    CHUNK = 1 << 16  # elements per pass (256 KiB in float32)

    def __init__(self, master: torch.Tensor, decay_ranges: list[tuple[int, int]],
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1):
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.master = master
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.steps_taken = 0
        self.decay_ranges = list(decay_ranges)

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: float | None, grad_scale: float = 1.0) -> None:
        """One update of `master` from `grad` (same length), multiplied by grad_scale (clipping,
        and unscaling an fp16 loss scale). In full precision `grad` is scaled in place: callers
        pass a gradient buffer they are done with. It may be in a narrower dtype than the master
        (mixed precision): then each chunk is upcast before it is scaled, so small fp16
        gradients are not flushed to zero by the unscaling."""
        if lr is None:
            raise ValueError("FlatAdamW takes its learning rate from each step (the caller's schedule)")
        beta1, beta2 = self.betas
        self.steps_taken += 1
        if self.weight_decay:
            for a, b in self.decay_ranges:
                self.master[a:b].mul_(1.0 - lr * self.weight_decay)
        bias1 = 1.0 - beta1 ** self.steps_taken
        bias2_sqrt = math.sqrt(1.0 - beta2 ** self.steps_taken)
        # Chunk by chunk: every elementwise pass below then runs on data already in cache, and the
        # one temporary (denom) is a chunk, not a copy of the whole vector. Elementwise, so the
        # result is bit-identical to whole-vector passes.
        for a in range(0, self.master.numel(), self.CHUNK):
            g, m, v, w = (t[a:a + self.CHUNK] for t in (grad, self.exp_avg, self.exp_avg_sq, self.master))
            g = g.to(w.dtype)  # a chunk-sized copy in mixed precision; the gradient itself in full precision
            if grad_scale != 1.0:
                g.mul_(grad_scale)
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            # Same operation order as torch.optim.AdamW, so float64 runs agree to ~1e-15.
            denom = v.sqrt().div_(bias2_sqrt).add_(self.eps)
            w.addcdiv_(m, denom, value=-lr / bias1)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.STATE_NAMES}

    def elementwise_states(self) -> int:
        """State tensors of the master's length besides the master: m and v."""
        return 2

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors this optimizer keeps between steps (their storages are its memory)."""
        return list(self.state_tensors().values())

    def scalar_state(self) -> dict:
        return {"steps_taken": self.steps_taken}

    @torch.no_grad()
    def load_state(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        for name, t in self.state_tensors().items():
            t.copy_(tensors[name])
        self.steps_taken = int(scalars["steps_taken"])


def flat_adamw_factory(cfg: TrainConfig):
    """The CLI's optimizer: FlatAdamW over the shard, decaying matrices and embeddings only (as GPT-2)."""

    def make(master: torch.Tensor, flat, shard_ranges) -> FlatAdamW:
        decay = flat.local_ranges(flat.decay_ranges(), shard_ranges)
        return FlatAdamW(master, decay, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay)

    return make
