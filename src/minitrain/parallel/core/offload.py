"""Where the optimizer's master weights and state live (`--train.offload`): on the device with the model (none),
in host memory (cpu; pinned when a GPU is present, so copies to and from it can overlap), or in memory-mapped
files (disk), which the kernel may write back and drop from memory, so they count as file pages, not as the
process's anonymous memory.

An OffloadStore hands out zeroed tensors of the optimizer's state by name; the optimizer updates them in place
wherever they are (FlatAdamW copies each gradient chunk to them and steps there), and the strategy publishes the
updated master to the parameters as it does without offload. The files are this rank's, made fresh when the
store opens (a crashed run's are replaced) and removed when it closes.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ...errors import ConfigError


class OffloadError(ConfigError):
    """The offload directory cannot hold the state (no space, no permission), or a file of it went missing."""


def host_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros in host memory, pinned when a GPU is present (copies to and from the device can then overlap)."""
    return torch.zeros(numel, dtype=dtype, pin_memory=torch.cuda.is_available())


def copy_converting_on_device(dst: torch.Tensor, src: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """dst.copy_(src) where src is in host memory and dst on a GPU in another dtype (an offloaded float32 master
    published to bf16 parameters): each chunk crosses the bus in src's dtype into a device buffer and is rounded
    there, the same rounding. Copied and converted at once, the master crosses several times slower than as it is
    (docs/zero.md, offload; benchmarks/offload_copies_gpu.py). Elsewhere a plain copy_."""
    if dst.device.type != "cuda" or src.device == dst.device or src.dtype == dst.dtype:
        return dst.copy_(src)
    return copy_through(dst, src, torch.empty(min(chunk, src.numel()), dtype=src.dtype, device=dst.device))


def copy_through(dst: torch.Tensor, src: torch.Tensor, stage: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src), 1-D, stage's length at a time: into `stage` as src is, then into dst (converted there)."""
    for a in range(0, src.numel(), stage.numel()):
        b = min(a + stage.numel(), src.numel())
        dst[a:b].copy_(stage[:b - a].copy_(src[a:b]))
    return dst


class CopyStream:
    """Copies between host memory and a GPU, run as the GPU runs them: issue(copy, device) enqueues the copy on the
    device's current stream and returns at once (a non_blocking copy to or from pinned memory), with a mark;
    wait(mark) blocks the host until everything issued up to that mark has landed (one stream: in order). So an
    offloaded step copies the next gradient chunk to the host, and the chunk it just stepped back to the device,
    while the host's Adam steps the chunk between. Where no GPU takes part (a CPU-only machine: host and device
    coincide) issue runs the copy and there is nothing to wait for: the same code, done in order."""

    def crosses(self, tensor, device: torch.device) -> bool:
        """Whether `tensor` must be copied to be used on `device` (a chunk of it then crosses through a buffer)."""
        return tensor.device != device

    def issue(self, copy: Callable[[], object], device: torch.device):
        copy()
        if device.type != "cuda":
            return None
        mark = torch.cuda.Event()
        mark.record(torch.cuda.current_stream(device))
        return mark

    def wait(self, mark) -> None:
        if mark is not None:
            mark.synchronize()


class OffloadStore:
    def __init__(self, mode: str, directory: str | os.PathLike, rank: int):
        if mode not in ("cpu", "disk"):
            raise ValueError(f"offload is cpu or disk, got {mode!r}")
        self.mode, self.directory, self.rank = mode, Path(directory), rank
        self.files: list[Path] = []  # each file this rank made
        self._maps: list[tuple[Path, int, int, mmap.mmap]] = []  # (file, address, bytes, mapping) of each mapped one
        if mode == "disk":
            self.directory.mkdir(parents=True, exist_ok=True)

    def zeros(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D tensor of `numel` elements, held where the store keeps state."""
        if self.mode == "cpu":
            return host_zeros(numel, dtype)
        return self._mapped(self.directory / f"rank-{self.rank:05d}-{name}.bin", numel, dtype)

    def scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Disk: a zeroed tensor for a transient copy of state (a checkpoint's snapshot or what a load reads) in a
        file of its own, removed from the directory at once: its pages are the kernel's to drop, and it is gone
        when the tensor is (or when the process ends, however it ends). None for cpu: host memory as usual."""
        if self.mode == "cpu":
            return None
        path = self.directory / f"rank-{self.rank:05d}-scratch-{name}.bin"
        tensor = self._mapped(path, numel, dtype, keep=False)
        path.unlink()
        return tensor

    def _mapped(self, path: Path, numel: int, dtype: torch.dtype, keep: bool = True) -> torch.Tensor:
        """A fresh file of numel elements, its blocks reserved, mapped as a tensor; `keep`: it is the store's (removed
        by close(), checked and released with the others)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if keep:
            self.files.append(path)
        try:
            with open(path, "wb+") as f:  # a fresh file (truncated if a crashed run left one): reads back as zeros
                # Its blocks reserved now: a sparse file on a full disk would end the process with SIGBUS at the
                # first write through the mapping, mid-step, instead of an error here.
                if hasattr(os, "posix_fallocate") and nbytes:
                    os.posix_fallocate(f.fileno(), 0, nbytes)
                else:
                    f.truncate(nbytes)
                if not nbytes:  # nothing to map
                    return torch.zeros(0, dtype=dtype)
                mapping = mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED)
        except OSError as e:
            path.unlink(missing_ok=True)
            if keep:
                self.close()
            raise OffloadError(f"offload: cannot reserve {nbytes:,} bytes for {path} ({e.strerror or e}); free "
                               "space there or choose another offload directory") from None
        tensor = torch.frombuffer(mapping, dtype=dtype)  # the tensor keeps the mapping alive
        if keep:
            self._maps.append((path, tensor.data_ptr(), nbytes, mapping))
        return tensor

    def copy_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        held = self.zeros(name, tensor.numel(), tensor.dtype)
        held.copy_(tensor.reshape(-1))
        self.release(held)  # written: in the file now, not in the process's memory
        return held

    def release(self, tensor: torch.Tensor | None = None) -> None:
        """Disk: give the pages of `tensor` (a view of a stored tensor; None: every one) back to the kernel. Their
        values stay in the file (a shared mapping's dirty pages are written back, not lost) and are paged in again
        when next touched, so the process holds only the chunk the optimizer is stepping, not the whole state in
        its resident memory. Nothing to do for cpu."""
        for _, address, nbytes, mapping in self._maps:
            if tensor is None:
                mapping.madvise(mmap.MADV_DONTNEED)
                continue
            start = tensor.data_ptr() - address
            if 0 <= start < nbytes:
                first = start - start % mmap.PAGESIZE  # madvise wants a page-aligned start
                mapping.madvise(mmap.MADV_DONTNEED, first,
                                min(nbytes, start + tensor.numel() * tensor.element_size()) - first)

    def check(self) -> None:
        """Disk: every file still at its size (OffloadError naming it if not). A file truncated under its mapping
        would end the process with SIGBUS at the next access; this says which file and why instead. (A file
        removed is no loss: the mapping keeps it until the run ends.)"""
        for path, _, nbytes, mapping in self._maps:
            size = mapping.size()  # the mapped file's own size, whatever its name now points at
            if size < nbytes:
                raise OffloadError(f"offload: {path} was truncated to {size:,} of {nbytes:,} bytes during the run; "
                                   "the optimizer state in it is lost: resume from the last checkpoint (and keep "
                                   "other programs out of the offload directory)")

    def close(self) -> None:
        """Remove this rank's files (the tensors mapping them stay readable until dropped)."""
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files.clear()
        self._maps.clear()
