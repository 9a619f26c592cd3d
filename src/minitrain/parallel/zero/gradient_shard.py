"""ZeRO-2's and ZeRO-3's gradient: this rank's shard of the averaged gradient, filled while backward runs.

No rank keeps a full gradient buffer. Each unit (one per block) gets a full-size buffer only while backward
fills it: as soon as the unit's last gradient lands, its reduce_scatter starts (overlapping the rest of
backward) into this rank's piece of the shard, and the buffer is freed once the reduction is done. With at
most MAX_INFLIGHT units in flight, a full gradient exists for about one unit at a time.

With gradient accumulation every micro-batch is reduced and added into the shard: keeping full gradients
across micro-batches (FSDP's no_sync) would undo the sharding this exists for.

Offloaded (ZeRO-Offload), the shard is one vector in host memory beside the optimizer's master, kept for the
run; each unit's reduction lands on the device and is copied out. Otherwise each piece is a tensor of its own
on the device, which zero(release=True) gives back and the unit's next reduction allocates again.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.nn as nn

from ...runtime.comm import Comm
from ..core.flat_parameters import FlatParameters, Ranges, Segment, local_views, missing_gradients
from ..core.memory_math import MemoryLedger
from ..core.offload import host_zeros
from ..core.piece_vector import PieceVector

MAX_INFLIGHT = 1  # unit reduce-scatters in flight before the oldest is waited for (bounds gradient memory)


class GradientShard:
    """The reduce-scatter of each unit's gradient into this rank's shard, as backward produces it.

    `handles` are the hooks it put on the parameters (the strategy removes them on close). `on_reduced(i)` is
    called once unit i's reduction has started (ZeRO-3 frees the unit's parameters then). `placeholders`: for a
    loop that reads p.grad, the object p.grad holds once its gradient is on its way to the shard, by name
    (user_loop/visible_grads.py's ShardedGradient); empty in the trainer, where p.grad becomes None.
    `average`: divide each backward's sum as it lands (a user's loop: the shard always holds averages, so a loop
    that skips zero_grad accumulates into it as torch's p.grad would)."""

    def __init__(self, flat: FlatParameters, comm: Comm, shard_ranges: Ranges, dtype: torch.dtype,
                 ledger: MemoryLedger, *, offloaded: bool, stage: int, placeholders: dict[str, object],
                 average: bool, on_reduced: Callable[[int], None]):
        self.flat, self.comm, self.shard_ranges, self.dtype, self.ledger = flat, comm, shard_ranges, dtype, ledger
        self.offloaded, self.stage, self.placeholders, self.average = offloaded, stage, placeholders, average
        self.on_reduced = on_reduced
        length = sum(b - a for a, b in shard_ranges)
        self.host_shard = host_zeros(length, dtype) if offloaded else None
        self.pieces: list[torch.Tensor | None] = (
            local_views(self.host_shard, shard_ranges) if offloaded else
            [torch.zeros(b - a, dtype=dtype, device=comm.device) for a, b in shard_ranges])
        self.handles = [flat.param(seg).register_post_accumulate_grad_hook(
                            lambda p, i=i, seg=seg: self._grad_ready(i, seg, p))
                        for i, unit in enumerate(flat.units) for seg in unit.segments]
        self._arrived: list[set[str]] = [set() for _ in flat.units]
        self._buffers: dict[int, torch.Tensor] = {}  # unit -> its full gradient, being filled by backward
        self._inflight: deque = deque()  # (unit, pending reduction, chunk or None, full buffer, adds)
        self._reduced: set[int] = set()
        self._fresh: dict[int, bool] = {}  # unit -> whether this backward's gradients started afresh (placeholders)
        self.intervals: list[tuple[float, float]] = []  # this step's reductions, (launched, completed)

    def held(self) -> torch.Tensor | PieceVector:
        """The shard as held between steps (pieces given back count nothing)."""
        if self.host_shard is not None:
            return self.host_shard
        held = [p for p in self.pieces if p is not None]
        return PieceVector(held or [torch.empty(0, dtype=self.dtype, device=self.comm.device)])

    def tensor(self) -> torch.Tensor | PieceVector:
        """The summed (or, with `average`, averaged) shard in local layout, once finish() returned."""
        if self.host_shard is not None:
            return self.host_shard
        # A unit no backward reduced since zero(release=True) gave its piece back holds zeros (a step with no backward).
        self.pieces = [torch.zeros(b - a, dtype=self.dtype, device=self.comm.device) if piece is None else
                       piece for piece, (a, b) in zip(self.pieces, self.shard_ranges)]
        return PieceVector(self.pieces)

    def zero(self, release: bool) -> None:
        """Zero the shard for the next step; release: give the device pieces back (torch's set_to_none)."""
        # A backward's reductions still in flight (gradients cleared without a step) land before the pieces they
        # write to are given back or zeroed; the next forward would otherwise retire them into a piece gone.
        self.retire_all()
        for name in self.placeholders:
            self.flat.param_named(name).grad = None
        if release and not self.offloaded:  # given back; each unit's next reduction allocates its piece again
            self.pieces = [None] * len(self.pieces)
        else:
            for piece in self.pieces:
                if piece is not None:  # (a piece given back is zeros already)
                    piece.zero_()
        self._reduced = set()
        self.intervals = []

    @torch.no_grad()
    def _grad_ready(self, i: int, seg: Segment, p: nn.Parameter) -> None:
        unit = self.flat.units[i]
        if seg.name in self._arrived[i]:
            missing = [s.name for s in unit.segments if s.name not in self._arrived[i]]
            raise RuntimeError(f"no gradient reached {', '.join(missing)} in the previous backward; ZeRO-{self.stage} "
                               "needs every parameter to take part in the loss (remove unused ones from the model)")
        self.retire_done()
        buffer = self._buffers.get(i)
        if buffer is None:
            # In the reduce dtype: copying the gradient in below widens it if mixed precision reduces in float32.
            # Uninitialised but for the padding: every segment is copied in before the reduction, and on the host
            # untouched pages take no memory until their gradient lands.
            buffer = self._buffers[i] = torch.empty(unit.stop - unit.start, dtype=self.dtype, device=p.device)
            buffer[sum(seg.numel for seg in unit.segments):].zero_()
            self.ledger.hold("grads", buffer)
        placeholder = self.placeholders.get(seg.name)
        carried = placeholder is not None and p.grad is placeholder  # p.grad not set to None since the last backward
        grad = p.grad.take() if carried else p.grad
        if self.placeholders:
            self._note_start(i, seg.name, carried)
        self.ledger.hold("grads", grad)  # autograd's tensor and its copy coexist for a moment
        buffer[seg.offset - unit.start:seg.offset - unit.start + seg.numel].copy_(grad.reshape(-1))
        self.ledger.drop("grads", grad)
        p.grad = placeholder
        self._arrived[i].add(seg.name)
        if len(self._arrived[i]) == len(unit.segments):
            self._arrived[i] = set()
            self._fresh.pop(i, None)
            self._reduce_unit(i)

    def _note_start(self, i: int, name: str, carried: bool) -> None:
        """A user's loop: a gradient autograd started afresh (p.grad was None: model.zero_grad(), or the
        optimizer's) means this unit's shard starts afresh too, as torch's gradient would; one carried by its
        placeholder adds to it. A unit with both is refused: its shard cannot be zeroed for some of them."""
        fresh = self._fresh.setdefault(i, not carried)
        if fresh == carried:
            raise RuntimeError(f"'{name}' kept its gradient since the last backward while others of its block did not "
                               f"(p.grad set to None for some parameters only): at ZeRO-{self.stage} zero every "
                               "gradient at once, with the optimizer's zero_grad() or model.zero_grad()")
        if fresh:
            self._reduced.discard(i)

    def _reduce_unit(self, i: int) -> None:
        while len(self._inflight) >= MAX_INFLIGHT:
            self._retire_oldest()
        buffer = self._buffers.pop(i)
        adds = i in self._reduced  # a later micro-batch: reduce beside the shard, then add
        length = self.shard_ranges[i][1] - self.shard_ranges[i][0]
        # Offloaded, the reduction lands on the device first.
        if adds or self.offloaded:
            chunk = torch.empty(length, dtype=self.dtype, device=buffer.device)
            self.ledger.hold("grads", chunk)
        else:  # straight into the piece: zero()'s zeros, or (given back) a new one the reduction fills whole
            chunk = None
            if self.pieces[i] is None:
                self.pieces[i] = torch.empty(length, dtype=self.dtype, device=buffer.device)
        target = self.pieces[i] if chunk is None else chunk
        self._inflight.append((i, self.comm.reduce_scatter_sum_async(target, buffer), chunk, buffer, adds))
        self._reduced.add(i)
        self.on_reduced(i)

    def retire_done(self) -> None:
        """Retire the reductions that have finished (their full gradients freed early), waiting for none."""
        while self._inflight and self._inflight[0][1].done():
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        i, pending, chunk, buffer, adds = self._inflight.popleft()
        self.intervals.append(pending.wait())
        if self.average and self.comm.world_size > 1:  # each backward's sum divided as it lands
            (self.pieces[i] if chunk is None else chunk).div_(self.comm.world_size)
        if chunk is not None:
            shard = self.pieces[i]
            if adds:  # on the shard's side (the host's, offloaded), as the step reads it
                shard.add_(chunk.to(shard.device))
            else:  # offloaded: into pinned memory without the host waiting (finish waits once for all)
                shard.copy_(chunk, non_blocking=True)
            self.ledger.drop("grads", chunk)
        self.ledger.drop("grads", buffer)

    @torch.no_grad()
    def retire_all(self) -> None:
        while self._inflight:
            self._retire_oldest()

    @torch.no_grad()
    def finish(self) -> list[tuple[float, float]]:
        """Wait for every reduction of this backward; returns their intervals (once: the next call returns none).
        Raises, naming them, if some parameters got no gradient."""
        self.retire_all()
        if self.offloaded and self.comm.device.type == "cuda":  # the host reads the shard next: its copies from
            torch.cuda.current_stream(self.comm.device).synchronize()  # the device have landed
        unreduced = [u for i, u in enumerate(self.flat.units) if i not in self._reduced or self._arrived[i]]
        if unreduced:
            missing = [s.name for u in unreduced for s in u.segments
                       if s.name not in self._arrived[self.flat.units.index(u)]]
            raise RuntimeError(missing_gradients(missing, self.flat, f"ZeRO-{self.stage}"))
        intervals, self.intervals = self.intervals, []
        return intervals
