"""Pipeline parallelism: the model's blocks split into P contiguous stages, one per rank of the
pipeline group, and every step's batch cut into M micro-batches that flow through them.

A model's plan splits it into this rank's stage in place (MiniGPT's: models/minigpt/plan.py keeps the
blocks of the stage, `stage_blocks`, the embeddings too on the first, the final LayerNorm, head and
loss on the last, and deletes the rest); the stage is still the model, whose forward runs the parts
it has. Parameters keep their full-model names and their place in the whole model's logical vector
(WholeModel), so a checkpoint saved by P stages loads into any other layout.

`Pipeline.run` executes one step's schedule (schedules.py: a list of F/B actions per stage):
- F m: receive micro-batch m's activation from the previous stage (the first stage embeds its
  tokens instead), run the stage, send the output on (the last stage computes the loss).
- B m: receive the gradient of that output from the next stage (the last stage starts from its
  loss), run backward, send the input's gradient back.
Each action's receive is batched with the previous action's send (`Comm.exchange`), so a stage
never blocks in a send. Stages exchange only (micro-batch, seq, d_model) activations and their
gradients, in the compute dtype.

Exactness: the loss of micro-batch m is the mean over its tokens; backward runs on it times
1 / (M x accumulation), so the gradients summed over micro-batches are those of the whole batch's
mean loss, as in the unpipelined step (all micro-batches have the same number of tokens).

Measured per step (`measured`): each stage's busy time (its compute) against the span of the whole
schedule (barrier to barrier over the pipeline group), so bubble = 1 - busy / span, comparable with
(P - 1) / (M + P - 1); and the most micro-batches whose activations it held at once. The times are the
comm's clock's (clock.py): the wall clock on the CPU, CUDA events on a GPU, read after the step's host
synchronisation, so no action waits for the device.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ...runtime.comm import Comm, PendingCollective
from .schedules import SCHEDULES, Action, expected_bubble, splits_backward
from .zero_bubble import SplitBackward


def stage_blocks(n_layer: int, stages: int) -> list[range]:
    """Contiguous blocks per stage, as even as possible (the first stages take one more)."""
    base, extra = divmod(n_layer, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


class Pipeline:
    def __init__(self, module: nn.Module, comm: Comm, schedule: str, microbatches: int, d_model: int,
                 dtype: torch.dtype, device: torch.device, forward_context: Callable, no_sync: Callable):
        """module: this rank's stage (the strategy's module); comm: the pipeline group, one rank per stage;
        dtype: what activations travel in; forward_context: entered around each forward (autocast);
        no_sync: the data-parallel strategy's context for backwards that must not sync gradients."""
        self.module, self.comm, self.device = module, comm, device
        self.stage, self.stages = comm.rank, comm.world_size
        self.first, self.last_stage = self.stage == 0, self.stage == self.stages - 1
        self.schedule, self.microbatches = schedule, microbatches
        lists = SCHEDULES[schedule](self.stages, microbatches)
        self.actions: list[Action] = lists[self.stage]
        # The last action that accumulates gradients: the data-parallel sync runs in it.
        self.final_backward = max(i for i, a in enumerate(self.actions) if a.kind in ("B", "W"))
        self.split = SplitBackward(module) if splits_backward(lists) else None
        self.d_model, self.dtype = d_model, dtype
        self.forward_context, self.no_sync = forward_context, no_sync
        self._measured: dict = {}  # the last step's bubble, busy and span seconds, peak in-flight micro-batches
        self._marks: tuple | None = None  # this step's clock marks, until they can be read (measured)

    def run(self, x: torch.Tensor, y: torch.Tensor, loss_multiplier: float, sync: bool,
            forward: Callable | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """One pass of the schedule over a batch (every stage gets the same x, y from its loader; the first
        stage reads x, the last y). loss_multiplier: what backward multiplies the batch's mean loss by
        (loss scale / accumulation); each micro-batch's loss gets 1/M of it. Gradients are synced across
        data-parallel replicas in the final backward, if `sync`. forward(input, target or None): what runs a
        micro-batch through this stage (default: the module itself); shape: of the activations stages
        exchange (default: micro-batch x sequence x d_model). Returns the batch's mean loss, a float64 tensor on
        the device (read when convenient), on the last stage; 0 elsewhere."""
        M = self.microbatches
        forward = forward or self.module
        xs, ys = x.to(self.device).chunk(M), y.to(self.device).chunk(M)
        shape = shape or (xs[0].size(0), xs[0].size(1), self.d_model)
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (stage input, stage output)
        # Zero-bubble: each micro-batch's noted module outputs until its B, then with their gradients until its W.
        noted_of: dict[int, list] = {}
        deferred: dict[int, tuple[list, list]] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # on the device: no sync per micro-batch
        outgoing: list[tuple[torch.Tensor, int]] = []  # the previous action's send, started with the next receive
        in_flight: list[PendingCollective] = []
        actions, peak, clock = [], 0, self.comm.clock
        self.comm.barrier()  # the span starts when every stage can start
        start = clock.mark()
        for i, action in enumerate(self.actions):
            m = action.microbatch
            incoming = self._incoming(action, shape)
            in_flight += self.comm.exchange(outgoing, incoming)
            outgoing = []
            began = clock.mark()  # after its input arrived: waiting for a neighbour is not busy
            if action.kind == "F":
                inp = xs[m] if self.first else incoming[0][0].requires_grad_()
                with self.forward_context(), self.split.noting() if self.split else contextlib.nullcontext() as noted:
                    out = forward(inp, ys[m] if self.last_stage else None)
                noted_of[m] = noted
                if self.last_stage:
                    loss_sum += out.detach().double()
                else:
                    out = out.to(self.dtype)  # differentiable: the received gradient comes back in this dtype
                    outgoing = [(out.detach(), self.stage + 1)]
                held[m] = (inp, out)
                peak = max(peak, len(held))
            elif action.kind == "W":  # this micro-batch's weight gradients, from what its B kept
                noted, grads = deferred.pop(m)
                del held[m]  # its graph goes with its last references
                with contextlib.nullcontext() if sync and i == self.final_backward else self.no_sync():
                    self.split.weight_part(noted, grads)
            else:
                inp, out = held[m] if self.split else held.pop(m)
                grad = torch.tensor(loss_multiplier / M, dtype=out.dtype, device=out.device) \
                    if self.last_stage else incoming[0][0]
                if self.split is not None:  # B alone: the input's gradient now, the weights' in W
                    noted = noted_of.pop(m)
                    inp_grad, grads = self.split.input_part(out, grad, None if self.first else inp, noted)
                    deferred[m] = (noted, grads)
                else:
                    with contextlib.nullcontext() if sync and i == self.final_backward else self.no_sync():
                        out.backward(grad)
                    inp_grad = inp.grad
                if not self.first:
                    outgoing = [(inp_grad, self.stage - 1)]
            # On a GPU the marks are events in the stream, so the action's kernels are charged to it without
            # the host waiting for them (no synchronisation per action).
            actions.append((action.kind, began, clock.mark()))
        in_flight += self.comm.exchange(outgoing, [])
        for send in in_flight:
            send.wait()
        self.comm.barrier()  # ...and ends when the last stage has finished
        self._marks = (start, clock.mark(), actions, peak)
        return loss_sum / M

    @property
    def measured(self) -> dict:
        """The last schedule's bubble (1 - busy / span), busy and span seconds, seconds per kind of action (F, B, W:
        their sums) and peak in-flight micro-batches, read from its clock marks once they are done: at once on the
        CPU; on a GPU after the step's host synchronisation (before it, the step before's)."""
        if self._marks is not None:
            start, end, actions, peak = self._marks
            clock = self.comm.clock
            if clock.ready(end):
                by_kind: dict[str, float] = {}
                for kind, a, b in actions:
                    by_kind[kind] = by_kind.get(kind, 0.0) + clock.seconds(b) - clock.seconds(a)
                busy, span = sum(by_kind.values()), clock.seconds(end) - clock.seconds(start)
                self._measured = {"bubble": 1 - busy / span if span > 0 else 0.0, "busy_s": busy, "span_s": span,
                                  "seconds_by_kind": by_kind, "peak_in_flight": peak}
                self._marks = None
        return self._measured

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forwards only, micro-batch after micro-batch (no backward, so no schedule to interleave): the
        batch's mean loss (float64) on the last stage, 0 elsewhere."""
        M = self.microbatches
        xs, ys = x.to(self.device).chunk(M), y.to(self.device).chunk(M)
        shape = (xs[0].size(0), xs[0].size(1), self.d_model)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        outgoing: list[tuple[torch.Tensor, int]] = []
        in_flight: list[PendingCollective] = []
        for m in range(M):
            incoming = [] if self.first else [(torch.empty(shape, dtype=self.dtype, device=self.device),
                                                self.stage - 1)]
            in_flight += self.comm.exchange(outgoing, incoming)
            with self.forward_context():
                out = self.module(xs[m] if self.first else incoming[0][0], ys[m] if self.last_stage else None)
            if self.last_stage:
                loss_sum += out.double()
                outgoing = []
            else:
                outgoing = [(out.to(self.dtype), self.stage + 1)]
        in_flight += self.comm.exchange(outgoing, [])
        for send in in_flight:
            send.wait()
        return loss_sum / M

    def _incoming(self, action: Action, shape: tuple[int, ...]) -> list[tuple[torch.Tensor, int]]:
        """The receive an action waits for: an activation from the previous stage, or a gradient from the next."""
        if action.kind == "F" and not self.first:
            return [(torch.empty(shape, dtype=self.dtype, device=self.device), self.stage - 1)]
        if action.kind == "B" and not self.last_stage:
            return [(torch.empty(shape, dtype=self.dtype, device=self.device), self.stage + 1)]
        return []

    def summary(self) -> dict:
        """The layout and the formula the measurement compares with."""
        return {"schedule": self.schedule, "stages": self.stages, "microbatches": self.microbatches,
                "expected_bubble": expected_bubble(self.stages, self.microbatches, self.schedule)}
