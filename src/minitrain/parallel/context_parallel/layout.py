"""Which tokens of every sequence a rank of a context-parallel group holds.

A sequence of T tokens is cut into 2N chunks of T / 2N; rank r of N holds chunks r and 2N - 1 - r, side by side.
Under a causal mask a query attends to every earlier key, so the chunks late in the sequence carry most of the
work; pairing an early chunk with a late one gives every rank the same number of (query, key) pairs to compute
(Megatron-LM's and torchtitan's load balancing; a contiguous T / N each would leave the last rank with 2N - 1
times the first rank's work).
"""
from __future__ import annotations

import torch


class ContextLayout:
    def __init__(self, rank: int, ranks: int):
        self.rank, self.ranks = rank, ranks

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunks (of 2N) a rank holds, in the order it holds them."""
        return rank, 2 * self.ranks - 1 - rank

    def check(self, seq_len: int) -> None:
        """ValueError unless the sequence cuts into 2N equal chunks."""
        if seq_len % (2 * self.ranks):
            raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2 x cp = {2 * self.ranks} equal "
                             f"chunks: context parallelism gives each of the {self.ranks} ranks two of them (one "
                             "early, one late, so the causal mask's work is even); use a length divisible by "
                             f"{2 * self.ranks}")

    def positions(self, seq_len: int, rank: int | None = None, device=None) -> torch.Tensor:
        """The positions in the whole sequence of the tokens `rank` (default: this one) holds, in its order."""
        chunk = seq_len // (2 * self.ranks)
        first, second = self.chunks_of(self.rank if rank is None else rank)
        return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                          torch.arange(second * chunk, (second + 1) * chunk, device=device)])

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (its two chunks along `dim`, side by side)."""
        self.check(x.size(dim))
        parts = x.chunk(2 * self.ranks, dim=dim)
        first, second = self.chunks_of(self.rank)
        return torch.cat([parts[first], parts[second]], dim=dim)
