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

import os
from pathlib import Path

import torch


class OffloadError(RuntimeError):
    """The offload directory cannot hold the state (no space, no permission)."""


def host_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros in host memory, pinned when a GPU is present (copies to and from the device can then overlap)."""
    return torch.zeros(numel, dtype=dtype, pin_memory=torch.cuda.is_available())


class OffloadStore:
    def __init__(self, mode: str, directory: str | os.PathLike, rank: int):
        if mode not in ("cpu", "disk"):
            raise ValueError(f"offload is cpu or disk, got {mode!r}")
        self.mode, self.directory, self.rank = mode, Path(directory), rank
        self.files: list[Path] = []
        if mode == "disk":
            self.directory.mkdir(parents=True, exist_ok=True)

    def zeros(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D tensor of `numel` elements, held where the store keeps state."""
        if self.mode == "cpu":
            return host_zeros(numel, dtype)
        path = self.directory / f"rank-{self.rank:05d}-{name}.bin"
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.files.append(path)
        try:
            with open(path, "wb") as f:  # a fresh file (truncated if a crashed run left one): reads back as zeros
                # Its blocks reserved now: a sparse file on a full disk would end the process with SIGBUS at the
                # first write through the mapping, mid-step, instead of an error here.
                if hasattr(os, "posix_fallocate") and nbytes:
                    os.posix_fallocate(f.fileno(), 0, nbytes)
                else:
                    f.truncate(nbytes)
        except OSError as e:
            self.close()
            raise OffloadError(f"offload: cannot reserve {nbytes:,} bytes for {path} ({e.strerror or e}); free "
                               "space there or choose another offload directory") from None
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)

    def copy_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        held = self.zeros(name, tensor.numel(), tensor.dtype)
        held.copy_(tensor.reshape(-1))
        return held

    def close(self) -> None:
        """Remove this rank's files (the tensors mapping them stay readable until dropped)."""
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files.clear()
