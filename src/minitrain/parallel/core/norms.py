"""Global norms and clipping, as the strategies compute them: float64 sums of squares and the clip coefficient."""
from __future__ import annotations

import warnings

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
    """sum(x**2) accumulated in float64, with no full-size temporary, chunk by chunk: float64 chunks where they
    lie, other dtypes through one float64 buffer reused for every piece of one norm (make one per norm
    computation; the buffer goes with it, so nothing is held between steps). Exact enough that the norm does
    not depend on how the vector is cut into shards (float32 partial sums would: ZeRO-1 and data parallel then
    clip by norms 1e-7 apart). A fresh chunk-sized copy per chunk would cost page faults whenever the allocator
    returns each to the system (as it does with MALLOC_MMAP_THRESHOLD_ set low; what that cost is in docs/zero.md);
    float32 accumulation over the whole vector would lose the precision the float64 chunks keep."""

    CHUNK = 1 << 18  # at most 2 MiB of float64
    # On a GPU each chunk is three kernel launches whatever its size: there 32 MiB, so that a step's two norms
    # (gradient and parameters) launch few kernels (the step times behind it: docs/single-process-speed.md).
    GPU_CHUNK = 1 << 22

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    @classmethod
    def block(cls, device: torch.device) -> int:
        """Elements per chunk on `device`: a vector cut at multiples of it gives the same sum (block_dots)."""
        return cls.GPU_CHUNK if device.type == "cuda" else cls.CHUNK

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dots = self.block_dots(x)
        if len(dots) == 1:  # one chunk: no running total to keep
            return dots[0]
        return sum_in_order(dots, x.device)

    def block_dots(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The sum of squares of each chunk of x, in order (float64 scalars on x's device): their sum in order
        (sum_in_order) is this object's result, so a vector cut into pieces at multiples of block() gives the same
        float64 sum, bit for bit, from its pieces' chunks (parameter servers, param_server/server.py; on a GPU to
        within float64 roundings: upcasting_square_sums). Float64 chunks are dotted where they are (chunks at the
        same offsets: the same alignment, the same rounding)."""
        chunk = self.block(x.device)
        if not x.numel():
            return [torch.zeros((), dtype=torch.float64, device=x.device)]
        if x.dtype == torch.float64:
            return [part.dot(part) for part in x.split(chunk)]
        if x.device.type == "cuda":
            return upcasting_square_sums(x, chunk)
        buffer = self._buffer
        if buffer is None or buffer.device != x.device or buffer.numel() < min(x.numel(), chunk):
            buffer = self._buffer = torch.empty(max(1, min(x.numel(), chunk)), dtype=torch.float64, device=x.device)
        dots = []
        for part in x.split(buffer.numel()):
            part = buffer[:part.numel()].copy_(part)
            dots.append(part.dot(part))
        return dots


def upcasting_square_sums(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Each chunk's sum of squares in float64 with no float64 copy of it (SquareSums' way on a GPU). There the
    copy and cuBLAS's float64 dot are a measurable share of the step for the gradient's and the parameters' norms
    (docs/gpu.md); torch.linalg.vector_norm(dtype=float64) makes the same copy inside. A compiled kernel reads each
    element once and keeps the float64 sum in registers. It sums in another order than the dot: the two agree to
    float64 summation's error (1e-13 relative at most, against the 1e-7 of a float32 sum), so pieces cut at
    multiples of the chunk agree with the whole vector to those roundings, not always to the bit as the CPU's
    copies do."""
    return [_float64_square_sum(part.detach()) for part in x.split(chunk)]


def _square_sum_in_float64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64).square().sum()


_compiled_square_sum = None  # torch.compile of the above, made at first use; False where compiling failed


def _float64_square_sum(x: torch.Tensor) -> torch.Tensor:
    """_square_sum_in_float64, compiled (one kernel: upcast, square and sum fused; any length, one graph); eager,
    with a chunk-sized float64 copy, where torch.compile cannot run (no Triton, no C++ compiler)."""
    global _compiled_square_sum
    if _compiled_square_sum is None:
        _compiled_square_sum = torch.compile(_square_sum_in_float64, dynamic=True)
    if _compiled_square_sum is not False:
        try:
            return _compiled_square_sum(x)
        except Exception as e:  # noqa: BLE001 - whatever stops the compiler, the eager form gives the same sum
            warnings.warn(f"norms: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); the float64 sums "
                          "of squares run eagerly, with a float64 copy of each chunk", stacklevel=2)
            _compiled_square_sum = False
    return _square_sum_in_float64(x)


def sum_in_order(dots, device: torch.device) -> torch.Tensor:
    """A running float64 total of `dots` from zero, first to last (SquareSums' order)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for dot in dots:
        total += dot
    return total
