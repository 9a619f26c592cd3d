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
synchronisation, so no action waits for the device. The trainer measures every step (its metrics report the
bubble); `prepare`'s pipeline does not, and spares the step the two barriers.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ...runtime.comm import Comm, PendingCollective
from .schedules import Action, expected_bubble, make_schedule, splits_backward
from .zero_bubble import SplitBackward


def stage_blocks(n_layer: int, stages: int) -> list[range]:
    """Contiguous blocks per stage, as even as possible (the first stages take one more)."""
    base, extra = divmod(n_layer, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def chunk_blocks(n_blocks: int, stage: int, stages: int, virtual: int = 1) -> list[range]:
    """The blocks of each of this stage's chunks, in chunk order: the blocks balanced over stages x virtual
    chunks, chunk c of stage s being virtual stage c x stages + s (one chunk per stage but for the interleaved
    schedule)."""
    parts = stage_blocks(n_blocks, stages * virtual)
    return [parts[c * stages + stage] for c in range(virtual)]


class Pipeline:
    def __init__(self, module: nn.Module, comm: Comm, schedule: str, microbatches: int, d_model: int,
                 dtype: torch.dtype, device: torch.device, forward_context: Callable, no_sync: Callable,
                 chunks: list[Callable] | None = None, virtual: int = 1, measure: bool = True):
        """module: this rank's stage (the strategy's module); comm: the pipeline group, one rank per stage;
        dtype: what activations travel in; forward_context: entered around each forward (autocast);
        no_sync: the data-parallel strategy's context for backwards that must not sync gradients; under the
        interleaved schedule, chunks: forward(input, target or None) of each of this rank's chunks, in chunk order,
        or virtual: how many chunks each rank holds, their forwards given to run; measure: time each step's
        schedule (`measured`) between two barriers over the pipeline group, which cost a step about as much as the
        rest of the executor's own work: off where nothing reads the measurement."""
        self.module, self.comm, self.device = module, comm, device
        self.stage, self.stages = comm.rank, comm.world_size
        self.first, self.last_stage = self.stage == 0, self.stage == self.stages - 1
        self.schedule, self.microbatches = schedule, microbatches
        self.chunks, self.virtual = chunks, len(chunks) if chunks else virtual
        lists = make_schedule(schedule, self.stages, microbatches, self.virtual)
        self.actions: list[Action] = lists[self.stage]
        # The last action that accumulates gradients: the data-parallel sync runs in it. Interleaved, the last one
        # touches one chunk's parameters only: every backward runs unsynced, and the sync follows them (run).
        self.final_backward = -1 if self.virtual > 1 else max(i for i, a in enumerate(self.actions) if a.kind in ("B", "W"))
        self.split = SplitBackward(module) if splits_backward(lists) else None
        self.d_model, self.dtype = d_model, dtype
        self.forward_context, self.no_sync, self.measure = forward_context, no_sync, measure
        self._measured: dict = {}  # the last step's bubble, busy and span seconds, peak in-flight micro-batches
        self._marks: tuple | None = None  # this step's clock marks, until they can be read (measured)

    def run(self, x: torch.Tensor, y: torch.Tensor, loss_multiplier: float, sync: bool,
            forward: Callable | list[Callable] | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """One pass of the schedule over a batch (every stage gets the same x, y from its loader; the first
        stage reads x, the last y). loss_multiplier: what backward multiplies the batch's mean loss by
        (loss scale / accumulation); each micro-batch's loss gets 1/M of it. Gradients are synced across
        data-parallel replicas in the final backward, if `sync`. forward(input, target or None): what runs a
        micro-batch through this stage (default: the module itself), or a list of them, one per chunk (default:
        the chunks given at construction); shape: of the activations stages
        exchange (default: micro-batch x sequence x d_model). Returns the batch's mean loss, a float64 tensor on
        the device (read when convenient), on the last stage; 0 elsewhere."""
        M = self.microbatches
        forwards = forward if isinstance(forward, list) else [forward] if forward else self.chunks or [self.module]
        if len(forwards) != self.virtual:
            raise ValueError(f"{len(forwards)} forwards for {self.virtual} chunks per rank")
        xs, ys = x.to(self.device).chunk(M), y.to(self.device).chunk(M)
        shape = shape or (xs[0].size(0), xs[0].size(1), self.d_model)
        # (chunk, micro-batch) -> (its input, its output); zero-bubble: its noted module outputs until its B, then
        # with their gradients until its W.
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        noted_of: dict[tuple[int, int], list] = {}
        deferred: dict[tuple[int, int], tuple[list, list]] = {}
        ahead, behind = (self.stage + 1) % self.stages, (self.stage - 1) % self.stages  # (round the ranks: chunks)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # on the device: no sync per micro-batch
        outgoing: list[tuple[torch.Tensor, int]] = []  # the previous action's send, started with the next receive
        in_flight: list[PendingCollective] = []
        actions, peak, clock = [], 0, self.comm.clock
        mark = clock.mark if self.measure else lambda: None  # (unmeasured: no clock read, no CUDA event, per action)
        posted = None  # the next action's receive, posted ahead (_receive)
        if self.measure:
            self.comm.barrier()  # the span starts when every stage can start
        start = mark()
        for i, action in enumerate(self.actions):
            m, key = action.microbatch, (action.chunk, action.microbatch)
            first, last = self._first(action.chunk), self._last(action.chunk)
            incoming, posted, sent = self._receive(i, outgoing, posted, shape)
            in_flight += sent
            outgoing = []
            began = mark()  # after its input arrived: waiting for a neighbour is not busy
            if action.kind == "F":
                inp = xs[m] if first else incoming[0][0].requires_grad_()
                run = forwards[action.chunk]
                with self.forward_context(), self.split.noting() if self.split else contextlib.nullcontext() as noted:
                    out = run(inp, ys[m] if last else None)
                noted_of[key] = noted
                if last:
                    loss_sum += out.detach().double()
                else:
                    out = out.to(self.dtype)  # differentiable: the received gradient comes back in this dtype
                    outgoing = [(out.detach(), ahead)]
                held[key] = (inp, out)
                peak = max(peak, len(held))
            elif action.kind == "W":  # this micro-batch's weight gradients, from what its B kept
                noted, grads = deferred.pop(key)
                del held[key]  # its graph goes with its last references
                with contextlib.nullcontext() if sync and i == self.final_backward else self.no_sync():
                    self.split.weight_part(noted, grads)
            else:
                inp, out = held[key] if self.split else held.pop(key)
                grad = torch.tensor(loss_multiplier / M, dtype=out.dtype, device=out.device) \
                    if last else incoming[0][0]
                if self.split is not None:  # B alone: the input's gradient now, the weights' in W
                    noted = noted_of.pop(key)
                    inp_grad, grads = self.split.input_part(out, grad, None if first else inp, noted)
                    deferred[key] = (noted, grads)
                else:
                    with contextlib.nullcontext() if sync and i == self.final_backward else self.no_sync():
                        out.backward(grad)
                    inp_grad = inp.grad
                if not first:
                    outgoing = [(inp_grad, behind)]
            # On a GPU the marks are events in the stream, so the action's kernels are charged to it without
            # the host waiting for them (no synchronisation per action).
            actions.append((action.kind, began, mark()))
        in_flight += self.comm.exchange(outgoing, [])
        for send in in_flight:
            send.wait()
        if sync and self.virtual > 1:
            self._sync_accumulated()
        if self.measure:
            self.comm.barrier()  # ...and ends when the last stage has finished
            self._marks = (start, clock.mark(), actions, peak)
        return loss_sum / M

    def _receive(self, i: int, outgoing: list, posted: tuple | None, shape: tuple[int, ...]) -> tuple:
        """Start the previous action's send and wait for action i's input. Returns (its [(buffer, peer)], the
        next action's receive if posted ahead, the sends in flight). Gloo moves a message only into a posted
        receive, so on the CPU the next action's receive is posted before this one computes and its transfer
        overlaps the computation; under NCCL a receive posted ahead would hold the pair's stream, and with it our
        own next send, until the neighbour sends, which may wait for that very send."""
        incoming, arriving = posted if posted is not None else (self._incoming(self.actions[i], shape), None)
        ahead = self.device.type == "cpu" and i + 1 < len(self.actions)
        following = self._incoming(self.actions[i + 1], shape) if ahead else []
        sent, received = self.comm.post(outgoing, (incoming if arriving is None else []) + following)  # one batch
        if arriving is None:
            arriving, received = (received[:len(incoming)], received[len(incoming):]) if following else (received, [])
        for receive in arriving:
            receive.wait()
        return incoming, (following, received) if following else None, sent

    def _sync_accumulated(self) -> None:
        """The data-parallel sync of gradients accumulated unsynced: one engine run in which every parameter receives
        a zero, so the strategy's hooks see them all arrive as in a backward (x + 0 is x). One zero, expanded to each
        parameter's shape without memory of its own."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        zero = torch.zeros((), dtype=params[0].dtype, device=params[0].device) if params else None
        torch.autograd.backward(params, [zero.expand_as(p) for p in params])

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
            for c in range(self.virtual):  # a micro-batch round the ranks, chunk by chunk
                first, last = self._first(c), self._last(c)
                incoming = [] if first else [(torch.empty(shape, dtype=self.dtype, device=self.device),
                                              (self.stage - 1) % self.stages)]
                in_flight += self.comm.exchange(outgoing, incoming)
                run = self.chunks[c] if self.chunks else self.module
                with self.forward_context():
                    out = run(xs[m] if first else incoming[0][0], ys[m] if last else None)
                if last:
                    loss_sum += out.double()
                    outgoing = []
                else:
                    outgoing = [(out.to(self.dtype), (self.stage + 1) % self.stages)]
        in_flight += self.comm.exchange(outgoing, [])
        for send in in_flight:
            send.wait()
        return loss_sum / M

    def _first(self, chunk: int) -> bool:
        """Whether this rank's chunk is the first virtual stage (it reads the tokens)."""
        return self.first and chunk == 0

    def _last(self, chunk: int) -> bool:
        """Whether this rank's chunk is the last virtual stage (it computes the loss)."""
        return self.last_stage and chunk == self.virtual - 1

    def _incoming(self, action: Action, shape: tuple[int, ...]) -> list[tuple[torch.Tensor, int]]:
        """The receive an action waits for: an activation from the previous (virtual) stage, or a gradient from the
        next; round the ranks under the interleaved schedule (the last rank's chunk c feeds the first's c + 1)."""
        if action.kind == "F" and not self._first(action.chunk):
            return [(torch.empty(shape, dtype=self.dtype, device=self.device), (self.stage - 1) % self.stages)]
        if action.kind == "B" and not self._last(action.chunk):
            return [(torch.empty(shape, dtype=self.dtype, device=self.device), (self.stage + 1) % self.stages)]
        return []

    def summary(self) -> dict:
        """The layout and the formula the measurement compares with."""
        return {"schedule": self.schedule, "stages": self.stages, "microbatches": self.microbatches,
                "expected_bubble": expected_bubble(self.stages, self.microbatches, self.schedule, self.virtual),
                "virtual_stages": self.virtual}
