"""ZeRO-2 with the full parameters held unit by unit, each unit's freed as soon as its gradient is reduced (FSDP's
SHARD_GRAD_OP, FSDP2's reshard_after_forward=False): the trainer's ZeRO-2 in full precision.

The parameters are laid out unit by unit (one per block), as ZeRO-3 lays them out, and this is ZeRO-3 (zero3.py)
without the free after each unit's forward:

  step's end:  all_gather every unit from the updated shards: the parameters are whole between steps;
  forward:     nothing to gather (a unit freed by an earlier micro-batch's backward is gathered again, and
               under a pipeline's 1F1B before its backward too, as ZeRO-3 does);
  backward:    when a unit's last gradient lands: reduce_scatter it into the gradient shard (zero.py) and free
               the unit's full parameters.

From its reduction to the end of the update a unit's full parameters are dead: the optimizer updates the shard and
the step ends by gathering the units again. Keeping them whole there (zero.py's Zero2) is what made ZeRO-2 hold
more than ZeRO-3 at the end of backward, where every stage peaks (autograd's gradients of a tied embedding are
there too): benchmarks/memory_by_phase_cli.py on gpt2-124m at 2 ranks measured 1825 MiB with the full parameters
kept, 1502 with each unit freed as here, against FSDP2's 1558.

What it gathers from is the shard, which in full precision is the optimizer's master itself: nothing is kept
that zero.py's Zero2 does not keep. make_strategy (parallel/__init__.py) uses zero.py's Zero2 instead
  - in mixed precision or offloaded, where the master is float32 or on the host: gathering would need a 16-bit
    copy of the shard on the device (2P/N bytes; on one GPU, as ZeRO-Offload's headline runs, the whole model
    again);
  - in a user's own loop (prepare()), whose code between loss.backward() and optimizer.step() may read a
    parameter: a freed one's storage cannot be read (it crashes the process rather than raising).
With gradient accumulation a unit freed by one micro-batch's backward is gathered again by the next forward, as
FSDP2 does: one more all-gather of the parameters for each micro-batch after the first.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..core.config import ParallelConfig
from ..core.piece_vector import PieceVector
from .zero3 import Zero3


class Zero2Units(Zero3):
    name = "zero2"
    stage = 2
    gathered_at_rest = True  # whole between steps: memory_bytes counts every unit

    @staticmethod
    def applies(model: nn.Module, pcfg: ParallelConfig) -> bool:
        """Whether ZeRO-2 frees units after backward (see the module docstring): full precision on the device, in
        the trainer's own loop."""
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        return not pcfg.user_loop and pcfg.offload == "none" and dtypes == {pcfg.master_dtype}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.master_is_params, "Zero2Units gathers from the master: see Zero2Units.applies"
        self._gather_all()

    def _set_down(self, i: int) -> None:
        """Kept: its reduction in backward frees it."""

    @torch.no_grad()
    def _gather_all(self) -> None:
        """Collective: every unit gathered afresh from the shards (a unit still whole has the values of before)."""
        for i in list(self._gathering):  # a prefetch in flight read the shard before it changed
            self._ensure(i)
        self._gathered.clear()
        for i in range(len(self.flat.units)):
            self._start_gather(i)
        for i in list(self._gathering):
            self._ensure(i)

    def _publish(self, published: torch.Tensor | None) -> None:
        """Nothing here: the optimizer updated the shard in place (it is the master), and _end_step gathers."""

    def _end_step(self) -> None:
        super()._end_step()
        self._gather_all()  # from the shard, updated or (a skipped update: non-finite gradients) as it was

    def _load_params(self, local: torch.Tensor) -> None:
        super()._load_params(local)
        self._gather_all()

    def _whole(self) -> bool:
        return len(self._gathered) == len(self.flat.units)

    def full_params(self) -> torch.Tensor:
        """Between steps from the units themselves, as zero.py's Zero2 reads its buffer: no collective."""
        if not self._whole():
            return super().full_params()
        return self.flat.to_logical(torch.cat(self._buffers_whole))

    def param_norm_tensor(self) -> torch.Tensor:
        """Between steps from the units themselves, as zero.py's Zero2 reads its buffer: no collective beyond its."""
        if not self._whole():
            return super().param_norm_tensor()
        whole = PieceVector(self._buffers_whole)
        return self._total_sum_sq(self._sum_sq_parts(whole, [(0, self.flat.padded_numel)])).sqrt()

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        state = super().state_snapshot()
        state["params"] = torch.cat(self._buffers_whole)  # what it holds between steps, as zero.py's Zero2 holds it
        return state

    def memory_bytes(self) -> dict[str, int]:
        held = super().memory_bytes()  # the shard (with the optimizer's state)
        held["params"] += sum(b.numel() * b.element_size() for b in self._buffers_whole)
        return held
