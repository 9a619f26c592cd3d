"""What the user's loop calls between prepare and optimizer.step(): no_sync for accumulation, clip_grad_norm_,
pipeline_step in place of forward + backward when the model is pipelined; and the per-step checks they share
(the loss scale this step's gradients carry, every rank of a replica fed alike)."""
from __future__ import annotations

import torch
from torch import nn

from ..parallel.user_loop.replica_state import check_feeds, feed_checksum
from .session import Prepared, state_of


def no_sync(model: nn.Module):
    """Context for all but the last micro-batch of an accumulated step: backward without the data-parallel
    gradient sync (defined at every ZeRO stage: stages 2 and 3 reduce each micro-batch into their sharded
    gradient, which keeps their memory sharded; 0 and 1 sync once, at the last)."""
    return state_of(model).strategy.no_sync()


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> float:
    """The global norm of this step's gradients (every rank, every shard; a tied weight counted once), the
    same float on every rank, as torch.nn.utils.clip_grad_norm_ returns it on one process (a Python float, not
    a tensor: float() and comparisons work alike, .item() does not); the coming optimizer.step() scales the
    gradients to at most max_norm. The 2-norm only (norm_type=2). Collective: call it on every rank, after
    backward and before optimizer.step(); called again before the step it returns the same norm (the scaling
    is the step's), where torch's returns the norm of gradients it has already clipped."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    if float(norm_type) != 2.0:
        raise ValueError(f"minitrain.clip_grad_norm_ clips by the 2-norm (norm_type=2.0), got norm_type={norm_type}")
    state = state_of(model)
    if state.settings["servers"]:  # the global norm is the servers' to compute: the push goes now (servers.py)
        if state.pushed_norm is not None:
            raise RuntimeError("clip_grad_norm_ was called already this step; with parameter servers it pushes the "
                               "gradient (the update is made then): call it once per step, before optimizer.step()")
        state.pushed_norm = state.optimizer.push(float(max_norm))
        return state.pushed_norm
    norm = state.strategy.grad_norm(loss_scale(state))
    state.max_norm = float(max_norm)
    return norm


def pipeline_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn) -> float:
    """Forward and backward of one batch through a pipelined model (prepare(pp=...)), in place of
    `loss_fn(model(inputs), targets).backward()`: the batch is cut into micro-batches that flow through the
    stages on the schedule; the gradients are synced over data-parallel replicas at the end, ready for
    clip_grad_norm_ and optimizer.step(). loss_fn(output, targets) -> the mean loss of a micro-batch (output is
    what the last piece returns, e.g. logits). Every rank of a pipeline passes the same inputs and targets (the
    first stage reads the inputs, the last the targets). Returns this batch's mean loss on every rank of the
    pipeline. Collective."""
    state = state_of(model)
    if state.pipeline is None:
        raise ValueError("pipeline_step is for a model prepared with pp > 1; with pp=1 call forward and backward")
    M = state.pipeline.microbatches
    if inputs.size(0) % M:
        raise ValueError(f"a batch of {inputs.size(0)} does not cut into microbatches={M} equal micro-batches")
    note_feed(state, (inputs, targets))
    shape = _activation_shape(state, inputs[:inputs.size(0) // M])
    loss = state.pipeline.run(inputs, targets, loss_scale(state), sync=True, forward=state.stage.forwards(loss_fn),
                              shape=shape)
    pp = state.topo.pp
    value = loss.reshape(1).to(device=state.topo.device, dtype=torch.float64)
    pp.broadcast(value, src=pp.world_size - 1)  # the last stage computed it
    return float(value)  # the one read of the device in a pipeline step


def loss_scale(state: Prepared) -> float:
    """What this step's gradients are multiplied by: fp16's loss scale (until unscale_), else 1."""
    if state.settings["precision"] != "fp16":
        return 1.0
    if state.scaler is None:
        raise RuntimeError("precision='fp16' needs its loss scaler: scaler = minitrain.GradScaler(optimizer), and "
                           "scaler.scale(loss).backward()")
    return state.scaler.loss_scale()


def note_feed(state: Prepared, values) -> None:
    """Fold what a tensor- or pipeline-parallel rank was fed into this step's checksum."""
    state.feed = feed_checksum(state.feed, values)


def check_fed_alike(state: Prepared) -> None:
    """With tensor, pipeline or context parallelism: every rank of a replica (of a context group: the sequences
    handed to context_shard) was fed the same since the last step (one small all_gather of each rank's checksum,
    read with the step's)."""
    topo = state.topo
    if state.feed is None or topo.tp.world_size * topo.pp.world_size * topo.cp.world_size == 1:
        return
    rows = topo.everyone.gather_rows(state.feed.reshape(1)).view(-1).tolist()
    state.feed = None
    if topo.cp.world_size > 1:  # a context group is cp adjacent ranks, reading the same sequences
        check_feeds(rows, [rank // topo.cp.world_size for rank in range(topo.world_size)], "sequences")
        return
    tp, dp = topo.tp.world_size, topo.dp.world_size
    check_feeds(rows, [(rank // tp) % dp for rank in range(topo.world_size)],
                "inputs" if state.pipeline is None else "inputs or targets")


def _activation_shape(state: Prepared, micro: torch.Tensor) -> tuple[int, ...]:
    """What the stages exchange for micro-batches like `micro`: the first stage's real forward of its pieces
    before the blocks gives it, broadcast over the pipeline (once per input shape)."""
    key = tuple(micro.shape)
    if key not in state.shapes:
        pp, device = state.topo.pp, state.topo.device
        dims = torch.zeros(8, dtype=torch.int64, device=device)
        if pp.rank == 0:
            shape = state.stage.activation_shape(micro.to(device))
            dims[0], dims[1:1 + len(shape)] = len(shape), torch.tensor(shape)
        pp.broadcast(dims, src=0)
        state.shapes[key] = tuple(int(d) for d in dims[1:1 + int(dims[0])])
    return state.shapes[key]
