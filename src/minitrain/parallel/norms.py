"""Global norms and clipping, as the strategies compute them: float64 sums of squares and the clip coefficient."""
from __future__ import annotations

import torch


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """Factor that scales gradients to a global norm of at most max_norm (1.0 if off)."""
    if max_norm <= 0 or grad_norm <= max_norm:
        return 1.0
    return max_norm / (grad_norm + 1e-6)


def clip_coefficient_tensor(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """clip_coefficient on the device, the same float64 arithmetic (nothing read back to the host)."""
    if max_norm <= 0:
        return torch.ones_like(grad_norm)
    return torch.where(grad_norm <= max_norm, torch.ones_like(grad_norm), max_norm / (grad_norm + 1e-6))


class SquareSums:
    """sum(x**2) accumulated in float64, with no full-size temporary: float64 as one dot product, other
    dtypes chunk by chunk through one float64 buffer reused for every piece of one norm (make one per norm
    computation; the buffer goes with it, so nothing is held between steps). Exact enough that the norm does
    not depend on how the vector is cut into shards (float32 partial sums would: ZeRO-1 and data parallel then
    clip by norms 1e-7 apart). A fresh chunk-sized copy per chunk would cost page faults whenever the allocator
    returns each to the system (with MALLOC_MMAP_THRESHOLD_ set low, 2 MiB chunks took 100 ms a step on a
    10.8M-parameter model); float32 accumulation over the whole vector is off by 1e-3 there."""

    CHUNK = 1 << 18  # at most 2 MiB of float64
    # On a GPU each chunk is three kernel launches: in 2 MiB chunks gpt2-124m's two norms a step (gradient and
    # parameters) were 950 chunks, about 3,000 launches. There 32 MiB.
    GPU_CHUNK = 1 << 22

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            return x.dot(x)
        buffer, chunk = self._buffer, self.GPU_CHUNK if x.is_cuda else self.CHUNK
        if buffer is None or buffer.device != x.device or buffer.numel() < min(x.numel(), chunk):
            buffer = self._buffer = torch.empty(min(x.numel(), chunk), dtype=torch.float64, device=x.device)
        if x.numel() <= buffer.numel():  # one chunk: no running total to keep
            part = buffer[:x.numel()].copy_(x)
            return part.dot(part)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for part in x.split(buffer.numel()):
            part = buffer[:part.numel()].copy_(part)
            total += part.dot(part)
        return total
