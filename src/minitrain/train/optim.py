"""AdamW on one flat vector of parameters, and the LR schedule (global-norm clipping: parallel/core/norms.py).

The same `FlatAdamW` serves data parallel (the vector is every parameter) and
ZeRO (the vector is this rank's shard), so the strategies differ only in how
gradients arrive and parameters leave, which is what the parity tests check.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

# The functional form of AdamW: the kernels torch.optim.AdamW runs, on tensors we hold.
from torch.optim.adamw import adamw

from ..config import TrainConfig
from ..parallel.core.offload import CopyStream, OffloadStore, host_zeros

# Devices with PyTorch's fused (single-kernel) AdamW; elsewhere its multi-tensor (foreach) form.
FUSED_DEVICES = ("cpu", "cuda")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based optimizer step `step`: linear warmup to cfg.lr,
    then cosine decay to cfg.lr * cfg.min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


class FlatAdamW:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) over one flat vector.

    State: `master`, the parameters it updates (it takes ownership of the tensor
    passed in), plus exp_avg (m) and exp_avg_sq (v) of the same length and dtype: 12
    bytes per parameter in float32 (the ZeRO paper's K), also when the model computes in
    bf16/fp16. `decay_ranges` are the
    [start, stop) ranges of `master` that get weight decay (matrices and
    embeddings; biases and LayerNorm gains do not, as in GPT-2).

    The update is PyTorch's own fused AdamW kernel (one pass over w, g, m and v per chunk, where
    the unfused form makes seven), with weight decay applied just before it, chunk by chunk, as
    torch.optim.AdamW applies it: the two agree to the last bit in float64 (tests/train/test_optim.py).
    On a GPU (fold_decay) the kernel applies the decay itself, as torch.optim.AdamW(fused=True) does (w -= lr *
    decay * w, rounded otherwise than w *= 1 - lr * decay): a chunk is then two calls, its runs with and without
    decay, each run with its own step count; a pass over the master and a kernel per decayed range fewer.
    """

    STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
    CHUNK = 1 << 20  # elements per kernel call: 4 MiB in float32, the most a mixed-precision step upcasts at once
    # On a GPU a chunk costs its handful of kernel launches whatever its size, so there chunks are larger: 16M
    # elements (a 64 MiB upcast; the step times behind it: docs/single-process-speed.md).
    GPU_CHUNK = 1 << 24

    @classmethod
    def chunk_for(cls, device: torch.device | str) -> int:
        """Elements stepped per kernel call where the master lives."""
        return cls.GPU_CHUNK if torch.device(device).type == "cuda" else cls.CHUNK

    def __init__(self, master: torch.Tensor, decay_ranges: list[tuple[int, int]],
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 store: OffloadStore | None = None, chunk: int | None = None, fold_decay: bool | None = None,
                 copies: CopyStream | None = None):
        """store: where the master and the state live (offload.py); None: where `master` is. chunk: elements
        stepped per kernel call (--train.offload_chunk_mb when offloaded: with disk, what is resident at once;
        by default chunk_for the master's device). fold_decay: the fused kernel applies the weight decay
        (default: where `master`, the parameters' copy, is on a GPU, wherever the store then keeps it). copies:
        how chunks cross between the gradient's or the parameters' device and the master's (offloaded from a GPU:
        ahead of the host's step, offload.CopyStream)."""
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.store, self.chunk = store, chunk or FlatAdamW.chunk_for(master.device)
        self.copies = copies or CopyStream()
        self.master = master if store is None else store.copy_of("master", master)
        zeros = (lambda name: torch.zeros_like(self.master)) if store is None else (
            lambda name: store.zeros(name, self.master.numel(), self.master.dtype))
        self.exp_avg = zeros("exp_avg")
        self.exp_avg_sq = zeros("exp_avg_sq")
        self.decay_ranges = list(decay_ranges)
        # The kernel counts steps in tensors it increments itself, one per chunk (each chunk's call adds its 1),
        # float32 (exact to 2**24 steps), where the master is (the host's when offloaded). A step the fused kernel
        # skips (found_inf) it also takes back from the count: the count is right on the device without the host
        # ever reading the gradient norm, so the trainer can read a step's statistics after the next step began.
        self._kernel = {"fused": True} if self.master.device.type in FUSED_DEVICES else {"foreach": True}
        # Offloaded from a GPU: the two pinned buffers the gradient's chunks land in by turns, and the host's upcast.
        self._landing: list[torch.Tensor] = []
        self._upcast: torch.Tensor | None = None
        # Where the parameters are on a GPU, also with the master offloaded from there to the host: the host's
        # fused kernel then folds it too, one pass over the master fewer (benchmarks/host_adam_vs_deepspeed.py).
        fold = master.device.type == "cuda" if fold_decay is None else fold_decay
        self._fold = bool(fold and "fused" in self._kernel and self.weight_decay)
        # Per chunk, the kernel calls that step it: (weight decay, [(start, stop), ...]). Folded, a chunk's runs
        # with decay and its runs without, each run counted by its own step tensor.
        self._calls = [self._chunk_calls(a, min(a + self.chunk, self.master.numel()))
                       for a in range(0, self.master.numel(), self.chunk)]
        runs = max(1, sum(len(runs) for calls in self._calls for _, runs in calls))
        self._steps = [torch.zeros((), dtype=torch.float32, device=self.master.device) for _ in range(runs)]

    def _chunk_calls(self, a: int, b: int) -> list[tuple[float, list[tuple[int, int]]]]:
        """The kernel calls for master[a:b]: one without decay over the whole chunk (the decay is a pass of its own
        before it), or, folded, the chunk cut at the decay ranges' ends into a call over the runs that decay and
        one over the runs that do not."""
        if not self._fold:
            return [(0.0, [(a, b)])]
        cuts = sorted({a, b} | {x for lo, hi in self.decay_ranges for x in (lo, hi) if a < x < b})
        runs = list(zip(cuts, cuts[1:]))
        decays = [any(lo <= x and y <= hi for lo, hi in self.decay_ranges) for x, y in runs]
        calls = [(self.weight_decay, [r for r, d in zip(runs, decays) if d]),
                 (0.0, [r for r, d in zip(runs, decays) if not d])]
        return [(wd, rs) for wd, rs in calls if rs]

    @property
    def skips_on_device(self) -> bool:
        """Whether step() can take the skip decision as a tensor (the fused kernel's found_inf)."""
        return "fused" in self._kernel

    @property
    def steps_taken(self) -> int:
        """Updates applied (skipped ones not counted): read from the device, so only when saving or inspecting."""
        return int(self._steps[0].item())

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: float | None, grad_scale: float | torch.Tensor = 1.0,
             found_inf: torch.Tensor | None = None, publish_to: torch.Tensor | None = None) -> None:
        """One update of `master` from `grad` (same length), multiplied by grad_scale (clipping,
        and unscaling an fp16 loss scale). In full precision `grad` is scaled in place: callers
        pass a gradient buffer they are done with. It may be in a narrower dtype than the master
        (mixed precision): then each chunk is upcast before it is scaled, so small fp16
        gradients are not flushed to zero by the unscaling.
        found_inf (a float32 0/1 tensor on the device, with skips_on_device): 1 leaves master, m and v
        untouched, decided on the device, so the host need not read the gradient norm to skip; the
        kernel also takes the step back from its count.
        publish_to: a tensor of the master's length (the parameters, maybe narrower, maybe on a GPU while the
        master is on the host) that gets each chunk of the master as soon as it is stepped, so the copy crosses
        while the next chunk is stepped; every copy has landed when step returns."""
        if lr is None:
            raise ValueError("FlatAdamW takes its learning rate from each step (the caller's schedule)")
        beta1, beta2 = self.betas
        if self.store is not None:
            self.store.check()  # a file truncated under its mapping: one clear error, not SIGBUS below
        where = self.master.device  # the device's, or the host's when the state is offloaded
        decay = 1.0 - lr * self.weight_decay
        if found_inf is not None:  # the same double arithmetic, as a tensor: 1 when skipping
            found_inf = found_inf.to(where)
            decay = (1.0 - (lr * self.weight_decay) * (1.0 - found_inf.double())).to(self.master.dtype)
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.to(where)
        # Chunk by chunk, so what the weight decay and the scaling touch is still in cache when the
        # kernel reads it, and a mixed-precision step upcasts one chunk, not the whole gradient.
        bounds = [(a, min(a + self.chunk, self.master.numel())) for a in range(0, self.master.numel(), self.chunk)]
        counts = iter(self._steps)
        stage, published = self._publish_stage(publish_to), None
        for (a, b), calls, g in zip(bounds, self._calls, self._chunks_where_master_is(grad, bounds)):
            if self.weight_decay and not self._fold:
                for lo, hi in self.decay_ranges:
                    if lo < b and hi > a:
                        self.master[max(lo, a):min(hi, b)].mul_(decay)
            w = self.master[a:b]
            g = self._scaled_chunk(g, w.dtype, where, grad_scale, out=self._upcast)
            for weight_decay, runs in calls:
                adamw([w[x - a:y - a] for x, y in runs], [g[x - a:y - a] for x, y in runs],
                      [self.exp_avg[x:y] for x, y in runs], [self.exp_avg_sq[x:y] for x, y in runs], [],
                      [next(counts) for _ in runs], amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                      weight_decay=weight_decay, eps=self.eps, maximize=False, found_inf=found_inf, **self._kernel)
            if publish_to is not None:
                published = self._publish_chunk(publish_to[a:b], w, stage)
            if self.store is not None:  # disk: this chunk's pages go back to the kernel, the file keeps them
                for t in (w, self.exp_avg[a:b], self.exp_avg_sq[a:b]):
                    self.store.release(t)
        self.copies.wait(published)  # one stream: the last copy landed, so did every one before it

    def _chunks_where_master_is(self, grad: torch.Tensor, bounds: list[tuple[int, int]]):
        """Each chunk of `grad` on the master's device. A GPU's gradient crosses to the host one chunk ahead: the
        copy of chunk k+1 is issued before chunk k is handed over, into the other of two pinned buffers kept for
        the run (chunk k is in one; the other held chunk k-1, already stepped), so it crosses while the host steps
        chunk k. Copied into fresh pageable memory instead, the gradient would cross many times slower than into
        pinned memory (docs/zero.md, offload; benchmarks/offload_copies_gpu.py)."""
        if not self.copies.crosses(grad, self.master.device):
            for a, b in bounds:
                yield grad[a:b]
            return
        if not self._landing or self._landing[0].dtype != grad.dtype:
            self._landing = [host_zeros(self.chunk, grad.dtype) for _ in range(2)]
            self._upcast = torch.empty(self.chunk, dtype=self.master.dtype)
        ahead = self._fetch(grad, bounds[0], self._landing[0])
        for k in range(len(bounds)):
            landed, mark = ahead
            if k + 1 < len(bounds):
                ahead = self._fetch(grad, bounds[k + 1], self._landing[(k + 1) % 2])
            self.copies.wait(mark)
            yield landed

    def _fetch(self, grad: torch.Tensor, bounds: tuple[int, int], landing: torch.Tensor):
        """grad[a:b] into `landing`, issued (not yet landed): the landing chunk and its copy's mark."""
        a, b = bounds
        landed = landing[:b - a]
        return landed, self.copies.issue(lambda: landed.copy_(grad[a:b], non_blocking=True), grad.device)

    def _publish_stage(self, publish_to: torch.Tensor | None) -> torch.Tensor | None:
        """For a master on the host published to a GPU's narrower parameters: a device buffer, one chunk long, each
        chunk crosses into as it is and is rounded from there (copy_converting_on_device's way; one converting copy
        across the bus is slower, docs/zero.md). None where a plain copy does."""
        if publish_to is None or publish_to.dtype == self.master.dtype or not self.copies.crosses(
                self.master, publish_to.device):
            return None
        return torch.empty(min(self.chunk, self.master.numel()), dtype=self.master.dtype, device=publish_to.device)

    def _publish_chunk(self, dst: torch.Tensor, w: torch.Tensor, stage: torch.Tensor | None):
        """The stepped chunk w of the master into dst, the parameters' chunk: issued, its mark returned. Through
        `stage` when there is one: the stream runs its copies in order, so the next chunk's copy into it waits for
        this one's rounding."""
        if stage is None:
            return self.copies.issue(lambda: dst.copy_(w, non_blocking=True), dst.device)
        return self.copies.issue(lambda: dst.copy_(stage[:w.numel()].copy_(w, non_blocking=True)), dst.device)

    @staticmethod
    def _scaled_chunk(g: torch.Tensor, dtype: torch.dtype, where: torch.device, grad_scale: float | torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """g * grad_scale in `dtype` on `where`: a chunk-sized copy in mixed precision or when offloaded (into `out`
        where given, a buffer of at least g's length on `where`), the gradient itself scaled in place otherwise. A
        narrower gradient on the master's device is upcast by the multiplication itself (a one-element `dtype`
        factor: the product is computed in `dtype`, each bf16 or fp16 element converted exactly first), one pass
        where a copy and then a scaling made two."""
        unscaled = not isinstance(grad_scale, torch.Tensor) and grad_scale == 1.0
        if g.dtype != dtype and g.device == where and not (unscaled and out is None):
            out = None if out is None else out[:g.numel()]
            if unscaled:
                return out.copy_(g)
            return torch.mul(g, torch.as_tensor(grad_scale, dtype=dtype, device=where).reshape(1), out=out)
        g = g.to(device=where, dtype=dtype)
        return g if unscaled else g.mul_(grad_scale)

    def release_pages(self) -> None:
        """Disk offload: after the strategy has published the master, its pages go back to the kernel too."""
        if self.store is not None:
            self.store.release()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.store is not None:
            self.store.check()
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
    def load_state(self, tensors: Mapping[str, torch.Tensor], scalars: dict) -> None:
        """tensors: each state by name (a checkpoint's are read when asked for: one at a time here)."""
        for name, t in self.state_tensors().items():
            t.copy_(tensors[name])
            if self.store is not None:
                self.store.release(t)  # in the file now
        for count in self._steps:
            count.fill_(int(scalars["steps_taken"]))


def flat_adamw_factory(cfg: TrainConfig, store: OffloadStore | None = None):
    """The CLI's optimizer: FlatAdamW over the shard, decaying matrices and embeddings only (as GPT-2), its master
    and state in `store` when offloaded."""

    def make(master: torch.Tensor, flat, shard_ranges) -> FlatAdamW:
        decay = flat.local_ranges(flat.decay_ranges(), shard_ranges)
        chunk = None if store is None else max(1, int(cfg.offload_chunk_mb * 2**20) // master.element_size())
        return FlatAdamW(master, decay, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay, store, chunk)

    return make
