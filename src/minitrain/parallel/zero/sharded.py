"""ZeRO-1 and ZeRO-2 (Rajbhandari et al., SC'20): optimizer state, then gradients, sharded.

Units (flat.py) are padded to a multiple of N; rank r owns the r-th chunk of
every unit and keeps only those elements of the master weights and Adam m and
v: 12*P/N bytes in float32 instead of 12*P. One step:
  1. reduce_scatter the gradient, unit by unit: rank r receives the sum over
     ranks of its chunk (then divides by N: the averaged gradient);
  2. the global gradient norm: each rank's sum of squares, all-reduced;
  3. Adam on the shard (clipped);
  4. all_gather the updated chunks back into every rank's full parameters.

ZeRO-1 keeps a full gradient buffer and one unit (the whole model). Its step 1 is
data parallel's bucketed all-reduce, overlapped with backward (buckets.py), and each
rank then reads its shard of the sum. An all-reduce moves twice a reduce-scatter's
bytes in theory, but it hides behind backward, which one reduce-scatter of the whole
model after backward cannot, and on gloo it is also the faster op (43 MB at 2 ranks:
39 ms against 88 ms). This is how PyTorch's ZeroRedundancyOptimizer is used (under
DDP) and DeepSpeed's stage 1 with overlap_comm.

ZeRO-2 (and ZeRO-3, zero3.py, built on it) keeps no full gradient buffer. Each block is a unit, and
as soon as backward has produced a unit's last gradient its reduce_scatter starts
(overlapping the rest of backward) into the rank's gradient shard (4*P/N bytes). A
unit's gradient exists in full only between its backward and the end of its
reduce_scatter, with at most MAX_INFLIGHT units in flight.

With gradient accumulation they reduce every micro-batch and add into the
shard: keeping full gradients across micro-batches (FSDP's no_sync) would undo
the sharding they exist for.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.nn as nn

from ...runtime.comm import Comm, PendingCollective
from ..core.buckets import GradientToReduce, OverlappedAllReduce
from ..core.config import ParallelConfig
from ..core.strategy import FlatStrategy, OptimizerFactory
from ..core.flat_parameters import Segment, local_views, missing_gradients
from ..core.offload import copy_converting_on_device, host_zeros
from ..core.piece_vector import PieceVector
from ..core.units import module_units, unit_layout
from ..user_loop.visible_grads import ShardedGradient

MAX_INFLIGHT = 1  # unit reduce-scatters in flight before the oldest is waited for (bounds gradient memory)


class ShardedStrategy(FlatStrategy):
    """Stages 1-3: the optimizer updates this rank's shard from the averaged gradient shard."""

    def _gradient_shard(self) -> torch.Tensor:
        """This rank's summed (not yet averaged) gradient shard, once the sync is finished."""
        raise NotImplementedError

    def _gathered_as_it_is(self) -> bool:
        """Whether the master is gathered from where it is, in its dtype (else through a copy on the device the
        collective runs on, in the parameters' dtype; an offloaded master is on the host)."""
        master, data = self.optimizer.master, self.flat.data
        return (master.dtype, master.device) == (data.dtype, data.device)

    def _gather_source(self) -> torch.Tensor:
        """A buffer for the master in the parameters' dtype, on the device the collective runs on (booked as
        parameters until _publish drops it)."""
        source = torch.empty(self.optimizer.master.numel(), dtype=self.flat.dtype, device=self.flat.data.device)
        self.ledger.hold("params", source)
        return source

    def _publish_target(self) -> torch.Tensor | None:
        if self.pcfg.offload == "none" or self._gathered_as_it_is():
            return None
        return self._gather_source()

    def _publish(self, published: torch.Tensor | None) -> None:
        """Make the updated master shard the parameters every rank computes with (in mixed
        precision, gathering the master rounded to the parameters' dtype: half the bytes).
        published: the master's copy the optimizer has made on the device (offloaded), gathered from."""
        master = self.optimizer.master  # at ZeRO-1 it may be this rank's chunk of flat.data: gathered in place
        source = published
        if source is None:
            source = master if self._gathered_as_it_is() else copy_converting_on_device(self._gather_source(), master)
        views = local_views(source, self.shard_ranges)
        pending = [self.comm.all_gather_async(self.flat.data[u.start:u.stop], view)
                   for u, view in zip(self.flat.units, views)]
        for p in pending:
            p.wait()
        if source is not master:
            self.ledger.drop("params", source)

    _grad: torch.Tensor | None = None  # this step's averaged gradient shard, once synced

    # The sync divides by N itself (a user's loop, user_loop): ZeRO-1 its whole buffer, which p.grad shows;
    # ZeRO-2/3 each backward's reduced sum as it lands, so the shard always holds averaged gradients, and a loop
    # that skips zero_grad accumulates into them as torch's p.grad would (dividing at the step instead would
    # divide what an earlier step left there again).
    _averaged_in_sync = False

    def _averaged_grad(self) -> torch.Tensor:
        if self._grad is None:
            self.finish_grad_sync()
            self._grad = self._gradient_shard()
            if not self._averaged_in_sync:
                self._average(self._grad)
        return self._grad

    def _end_step(self) -> None:
        self._forget_sync()

    def _forget_sync(self) -> None:
        self._grad = None  # this step's averaged shard: the next step takes its own

    @torch.no_grad()
    def _load_params(self, local: torch.Tensor) -> None:
        """Every rank restores its own shard; the full parameters are gathered from them."""
        local = local.to(device=self.flat.data.device, dtype=self.flat.dtype)  # a checkpoint is read on the host
        for u, view in zip(self.flat.units, local_views(local, self.shard_ranges)):
            self.comm.all_gather(self.flat.data[u.start:u.stop], view)


class Zero1(ShardedStrategy):
    name = "zero1"
    stage = 1

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        super().__init__(model, comm, pcfg, make_optimizer, **kwargs)
        self.to_reduce = GradientToReduce(self.flat, self.ledger, self.sum_dtype)
        self.overlapped = OverlappedAllReduce(self.flat, comm, self.to_reduce, int(pcfg.bucket_mb * 2**20))
        self.hooks += self.overlapped.handles
        self.buckets = self.overlapped.buckets
        self._synced = False
        # A loop that reads p.grad gets every gradient averaged, as at data parallel: the whole summed buffer is
        # divided (not only this rank's shard), when backward ends.
        self._averaged_in_sync = pcfg.user_loop
        self._sync_when_backward_ends(lambda: not self.overlapped.enabled)

    def no_sync(self):
        return self.overlapped.no_sync()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        if not self._synced:
            self.flat.grads_in_place()
            backward_end = self.comm.clock.mark()
            intervals = self.overlapped.finish()
            self.sync_at(len(self.buckets), intervals, backward_end)
            self._synced = True
            if self._averaged_in_sync:
                self._show_averaged(self._average(self.to_reduce.tensor()))

    def _gradient_shard(self) -> torch.Tensor:
        """This rank's range of the summed gradient: a view (one unit, the whole model, gives one range)."""
        (start, stop), = self.shard_ranges
        return self.to_reduce.tensor()[start:stop]

    def _forget_sync(self) -> None:
        super()._forget_sync()
        self._synced = False
        self.to_reduce.release()


class Zero2(ShardedStrategy):
    """ZeRO-2 with the full parameters whole all the time, in one flat buffer (DeepSpeed's stage 2), and the
    gradient shard that ZeRO-3 (zero3.py) and ZeRO-2 with units freed after backward (zero2_units.py) share."""
    name = "zero2"
    stage = 2

    def __init__(self, model: nn.Module, comm: Comm, pcfg: ParallelConfig, make_optimizer: OptimizerFactory,
                 **kwargs):
        plans = module_units(model)
        super().__init__(model, comm, pcfg, make_optimizer, units=unit_layout(plans), keep_grad=False, **kwargs)
        self.plans = plans
        # The gradient shard, one piece per unit (piece_vector.py). Offloaded, views of one vector in host memory
        # beside the master (ZeRO-Offload), kept for the run: each unit's reduce-scatter lands on the device and is
        # copied out. Otherwise tensors of their own on the device the gradients are reduced on, which
        # zero_grad(release=True) gives back and each unit's next reduction allocates again.
        self.grad_offloaded = pcfg.offload != "none"
        self._host_shard = host_zeros(self.optimizer.master.numel(), self.reduce_dtype) if self.grad_offloaded else None
        self._pieces: list[torch.Tensor | None] = (
            local_views(self._host_shard, self.shard_ranges) if self.grad_offloaded else
            [torch.zeros(b - a, dtype=self.reduce_dtype, device=comm.device) for a, b in self.shard_ranges])
        for i, unit in enumerate(self.flat.units):
            for seg in unit.segments:
                self.hooks.append(self.flat.param(seg).register_post_accumulate_grad_hook(
                    lambda p, i=i, seg=seg: self._grad_ready(i, seg, p)))
        self._arrived: list[set[str]] = [set() for _ in self.flat.units]
        self._buffers: dict[int, torch.Tensor] = {}  # unit -> its full gradient, being filled by backward
        self._inflight: deque[tuple[int, PendingCollective, torch.Tensor | None, torch.Tensor]] = deque()
        self._reduced: set[int] = set()
        self._fresh: dict[int, bool] = {}  # unit -> whether this backward's gradients started afresh (user_loop)
        self._intervals: list[tuple[float, float]] = []
        # What p.grad holds once its gradient is on its way to the shard: None, or for a loop that reads p.grad a
        # ShardedGradient that says so (visible_grads.py).
        self._sharded_grads = {seg.name: ShardedGradient(self.flat.param(seg), seg.name, self.stage)
                               for seg in self.flat.segments} if pcfg.user_loop else {}
        self._averaged_in_sync = pcfg.user_loop
        # A new forward means the last backward is over: finish its reductions now, so with
        # gradient accumulation the last unit's full gradient does not sit through a forward.
        self.hooks.append(model.register_forward_pre_hook(self._eager(lambda _m, _args: self._retire_all())))

    def _eager(self, hook):
        """A hook of the model's that gathers, frees or waits on collectives, run as it is where a user compiles the
        model after prepare (torch.compile would trace it). Only in a user's loop: torch.compiler.disable imports
        torch.compile's machinery, which the CLI's processes need not pay for."""
        return torch.compiler.disable(hook) if self.pcfg.user_loop else hook

    def held_grads(self) -> torch.Tensor | PieceVector:
        if self._host_shard is not None:
            return self._host_shard
        held = [p for p in self._pieces if p is not None]
        return PieceVector(held or [torch.empty(0, dtype=self.reduce_dtype, device=self.comm.device)])

    def zero_grad(self, release: bool = False) -> None:
        # A backward's reductions still in flight (gradients cleared without a step) land before the pieces they
        # write to are given back or zeroed; the next forward would otherwise retire them into a piece gone.
        self._retire_all()
        self._end_abandoned_step()
        for name in self._sharded_grads:
            self.flat.param_named(name).grad = None
        if release and not self.grad_offloaded:  # given back; each unit's next reduction allocates its piece again
            self._pieces = [None] * len(self._pieces)
        else:
            for piece in self._pieces:
                if piece is not None:  # (a piece given back is zeros already)
                    piece.zero_()
        self._reduced = set()
        self._intervals = []

    @torch.no_grad()
    def _grad_ready(self, i: int, seg: Segment, p: nn.Parameter) -> None:
        unit = self.flat.units[i]
        if seg.name in self._arrived[i]:
            missing = [s.name for s in unit.segments if s.name not in self._arrived[i]]
            raise RuntimeError(f"no gradient reached {', '.join(missing)} in the previous backward; ZeRO-{self.stage} "
                               "needs every parameter to take part in the loss (remove unused ones from the model)")
        self._retire_done()
        buffer = self._buffers.get(i)
        if buffer is None:
            # In the reduce dtype: copying the gradient in below widens it if mixed precision reduces in float32.
            # Uninitialised but for the padding: every segment is copied in before the reduction, and on the host
            # untouched pages take no memory until their gradient lands.
            buffer = self._buffers[i] = torch.empty(unit.stop - unit.start, dtype=self.reduce_dtype, device=p.device)
            buffer[sum(seg.numel for seg in unit.segments):].zero_()
            self.ledger.hold("grads", buffer)
        carried = isinstance(p.grad, ShardedGradient)  # p.grad not set to None since the last backward
        grad = p.grad.take() if carried else p.grad
        if self._sharded_grads:
            self._note_start(i, seg.name, carried)
        self.ledger.hold("grads", grad)  # autograd's tensor and its copy coexist for a moment
        buffer[seg.offset - unit.start:seg.offset - unit.start + seg.numel].copy_(grad.reshape(-1))
        self.ledger.drop("grads", grad)
        p.grad = self._sharded_grads.get(seg.name)
        self._arrived[i].add(seg.name)
        if len(self._arrived[i]) == len(unit.segments):
            self._arrived[i] = set()
            self._fresh.pop(i, None)
            self._reduce_unit(i)

    def _note_start(self, i: int, name: str, carried: bool) -> None:
        """A user's loop (user_loop): a gradient autograd started afresh (p.grad was None: model.zero_grad(), or
        the optimizer's) means this unit's shard starts afresh too, as torch's gradient would; one carried by its
        ShardedGradient adds to it. A unit with both is refused: its shard cannot be zeroed for some of them."""
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
        if adds or self.grad_offloaded:
            chunk = torch.empty(length, dtype=self.reduce_dtype, device=buffer.device)
            self.ledger.hold("grads", chunk)
        else:  # straight into the piece: zero_grad's zeros, or (given back) a new one the reduction fills whole
            chunk = None
            if self._pieces[i] is None:
                self._pieces[i] = torch.empty(length, dtype=self.reduce_dtype, device=buffer.device)
        target = self._pieces[i] if chunk is None else chunk
        self._inflight.append((i, self.comm.reduce_scatter_sum_async(target, buffer), chunk, buffer, adds))
        self._reduced.add(i)
        self._unit_reduced(i)

    def _unit_reduced(self, i: int) -> None:
        """Called once unit i's gradient reduction has started (ZeRO-3 frees its parameters)."""

    def _retire_done(self) -> None:
        """Retire the reductions that have finished (their full gradients freed early), waiting for none."""
        while self._inflight and self._inflight[0][1].done():
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        i, pending, chunk, buffer, adds = self._inflight.popleft()
        self._intervals.append(pending.wait())
        if self._averaged_in_sync:  # the shard holds averages: each backward's sum is divided as it lands
            self._average(self._pieces[i] if chunk is None else chunk)
        if chunk is not None:
            shard = self._pieces[i]
            if adds:  # on the shard's side (the host's, offloaded), as the step reads it
                shard.add_(chunk.to(shard.device))
            else:  # offloaded: into pinned memory without the host waiting (finish_grad_sync waits once for all)
                shard.copy_(chunk, non_blocking=True)
            self.ledger.drop("grads", chunk)
        self.ledger.drop("grads", buffer)

    @torch.no_grad()
    def _retire_all(self) -> None:
        while self._inflight:
            self._retire_oldest()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        backward_end = self.comm.clock.mark()
        self._retire_all()
        if self.grad_offloaded and self.comm.device.type == "cuda":  # the host reads the shard next: its copies
            torch.cuda.current_stream(self.comm.device).synchronize()  # from the device have landed
        unreduced = [u for i, u in enumerate(self.flat.units) if i not in self._reduced or self._arrived[i]]
        if unreduced:
            missing = [s.name for u in unreduced for s in u.segments
                       if s.name not in self._arrived[self.flat.units.index(u)]]
            raise RuntimeError(missing_gradients(missing, self.flat, f"ZeRO-{self.stage}"))
        if self._intervals:
            self.sync_at(len(self.flat.units), self._intervals, backward_end)
            self._intervals = []

    def _gradient_shard(self) -> torch.Tensor | PieceVector:
        if self._host_shard is not None:
            return self._host_shard
        # A unit no backward reduced since zero_grad gave its piece back holds zeros (a step with no backward).
        self._pieces = [torch.zeros(b - a, dtype=self.reduce_dtype, device=self.comm.device) if piece is None else
                        piece for piece, (a, b) in zip(self._pieces, self.shard_ranges)]
        return PieceVector(self._pieces)
