"""One vector held as consecutive pieces, each its own tensor: ZeRO-2/3's gradient shard, one chunk per unit.

Each unit's reduce-scatter lands in a tensor of its own, allocated when it starts. So after zero_grad has
given the shard back, it comes back unit by unit as backward frees activations, as FSDP2's sharded gradients
do, on a GPU's allocator as on the host, and is never put together into one tensor: that would hold it twice
for a moment (the pieces and the whole), a full gradient's worth at 2 ranks, which ZeRO-2 exists never to hold.

The step reads it as one vector in local layout through the few operations it uses: a range (a view of one
piece, or a copy where the range crosses pieces: the optimizer's and the norm's chunks are a few MiB), writing
a range back, scaling in place, and its length and dtype.
"""
from __future__ import annotations

import torch


class PieceVector:
    """Consecutive 1-D tensors of one dtype, read and written as one vector."""

    def __init__(self, pieces: list[torch.Tensor]):
        if not pieces:
            raise ValueError("a PieceVector needs at least one piece")
        self.pieces = pieces
        self.starts = [0]
        for piece in pieces:
            self.starts.append(self.starts[-1] + piece.numel())

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].dtype

    @property
    def device(self) -> torch.device:
        return self.pieces[0].device

    def numel(self) -> int:
        return self.starts[-1]

    def element_size(self) -> int:
        return self.pieces[0].element_size()

    def nbytes_held(self) -> int:
        """Bytes of the pieces' storages, each once."""
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.pieces}
        return sum(storages.values())

    def _parts(self, a: int, b: int):
        """(piece, start in it, stop in it, start in [a, b)) covering [a, b), in order."""
        for piece, lo, hi in zip(self.pieces, self.starts, self.starts[1:]):
            if lo < b and hi > a:
                yield piece, max(a, lo) - lo, min(b, hi) - lo, max(a, lo) - a

    def __getitem__(self, index: slice) -> torch.Tensor:
        """[a:b]: a view when it lies in one piece, else a copy (read it; write back with item assignment)."""
        a, b, step = index.indices(self.numel())
        if step != 1:
            raise IndexError("a PieceVector is read in contiguous ranges only")
        parts = [piece[lo:hi] for piece, lo, hi, _ in self._parts(a, b)]
        if not parts:
            return self.pieces[0][:0]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def __setitem__(self, index: slice, value: torch.Tensor) -> None:
        a, b, step = index.indices(self.numel())
        if step != 1 or value.numel() != b - a:
            raise IndexError(f"[{a}:{b}] cannot take {value.numel()} elements")
        for piece, lo, hi, at in self._parts(a, b):
            piece[lo:hi].copy_(value[at:at + hi - lo])

    def split(self, size: int) -> list[torch.Tensor]:
        """The vector in ranges of `size` elements (the last shorter), as torch.Tensor.split gives them."""
        return [self[a:a + size] for a in range(0, self.numel(), size)]

    def div_(self, value) -> PieceVector:
        for piece in self.pieces:
            piece.div_(value)
        return self


def held_bytes(vector: torch.Tensor | PieceVector) -> int:
    """Bytes of the storage (or storages) holding a vector."""
    return vector.nbytes_held() if isinstance(vector, PieceVector) else vector.untyped_storage().nbytes()
