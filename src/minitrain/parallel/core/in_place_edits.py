"""A user's in-place edits of parameters between steps, taken into the master the optimizer steps.

Where the optimizer steps a master kept apart from the parameters (ZeRO-2, mixed precision, offload), a parameter
edited in place between steps (`with torch.no_grad(): p.clamp_(...)`, torch.nn.init on a layer) would be
overwritten by the next step's publication of the master. Every in-place op on a parameter counts up its version,
which the strategy's own writes (through the flat buffer) do not: a changed version is the user's edit, found at
the cost of reading one number per parameter. An edit through `p.data` counts up another tensor's version and is
not seen.
"""
from __future__ import annotations

import torch

from .flat_parameters import FlatParameters, Ranges


class InPlaceEdits:
    """The versions of the parameters of `flat` as of the last step; take() copies the edited ones into this rank's
    master (the optimizer's, over `shard_ranges`)."""

    def __init__(self, flat: FlatParameters, shard_ranges: Ranges, optimizer):
        self.flat, self.shard_ranges, self.optimizer = flat, shard_ranges, optimizer
        self.watched = [(seg, flat.param(seg)) for seg in flat.segments if seg.numel]
        self.note()

    def note(self) -> None:
        """The parameters as they are now are the master's (a step published them, or a load set both)."""
        self.versions = [p._version for _, p in self.watched]

    @torch.no_grad()
    def take(self) -> None:
        """The parameters edited in place since note(): their values into this rank's master (rounded values in
        mixed precision: the edit is what the parameter now holds)."""
        edited = [seg for (seg, p), seen in zip(self.watched, self.versions) if p._version != seen]
        if not edited:
            return
        at = 0  # where each shard range starts in the master
        for a, b in self.shard_ranges:
            for seg in edited:
                lo, hi = max(a, seg.offset), min(b, seg.offset + seg.numel)
                if lo < hi:
                    self.optimizer.master[at + lo - a:at + hi - a].copy_(self.flat.data[lo:hi])
            at += b - a
        self.note()
