"""Parameter servers (Li et al., OSDI 2014): synchronous, or with bounded staleness (stale-synchronous parallel,
Ho et al., NIPS 2013). Who is which: runtime/servers.py.

Server s holds the master weights and optimizer state of the s-th contiguous shard of the flat parameter vector
(the layout data parallel uses, core/flat_parameters.py). A worker holds the whole model, computes its gradient
on its own data, pushes each shard of it to that shard's server and pulls the updated shards back:

  worker w, step c:  forward and backward on its parameters, whose shard s is at version v_s
                     -> each server: a header (c, v_s, lr, loss scale, clip) and the gradient's shard
                     <- each server, once its version is >= c - K (after the last step: the last version):
                        a header (version, norm, step count, ending, staleness per worker) and the shard
  server, update u:  once every worker's gradient of step u is in: their sum in worker order, divided by W (data
                     parallel's all-reduce sum, then its division), the global norm (squares summed over the
                     servers), the clipped optimizer step on the shard. Its version is then u.

K = 0: a worker waits for its own step's update: data parallel by another route, bit for bit at two workers (the
all-reduce's a + b in either order is the same sum). K > 0: a worker may compute step c on parameters as old as
version c - 1 - K, so it runs up to K steps ahead of the slowest worker and blocks there; a server answers with
the newest version it has. The staleness of a gradient is the number of updates between the version it was
computed on and the update it goes into (u - 1 - v), recorded for every update.

How gradients are applied: as they arrive each is held for its step, and the step's update is applied once the
last worker's has come, as one optimizer step on their mean (each gradient scaled by 1/W). The SSP papers apply
every worker's update on arrival, scaled by 1/W, to plain SGD, where the two are the same sum; with a stateful
optimizer (Adam) W updates per step on fractions of the gradient would be another optimizer than the user's, and
K = 0 would no longer be data parallel. A server therefore holds up to K + 1 steps of W gradient shards.

Elastic (--ps.elastic, K >= 1): the launcher lets a worker other than worker 0 die and posts its departure in the
run's store; worker 0 watches for it and tells every server (DepartureWatch), since a server that waits for a
message from whichever worker sends first is never told by the transport that one of them died. From then on an
update is complete with the gradients of the workers still there, and is their mean. With two or more servers,
each says which workers' gradients it holds for the update and they apply the ones all of them hold (a worker that
died between its pushes to two servers reached only one). The replies say whose gradients went into the update,
and a save then meets over those workers alone (save_topology). The one that left is not replaced: the others go
on with their own data shards, so its shard of every later batch is skipped.
"""
from __future__ import annotations

import math

import torch

# A message is a header (float64: kind, step, version, lr, loss scale, clip, epoch, groups), then what its kind
# brings (a push through the API: its gradient, then the learning rate of each of its `groups` param groups). A
# server takes headers from whichever worker sends first; the rest of a message comes from that worker on its own
# tag. The epoch counts the checkpoints a worker has loaded: a request made after a load (a loss spike's rollback)
# waits at the server until worker 0's LOAD of that state has come, whichever arrives first.
HEADER, GRADIENT, REPLY, PARAMS, STATE, SUMMARY, GROUP_LRS = 1, 2, 3, 4, 5, 6, 7  # tags
HEADER_LEN = 8
PUSH, SYNC, FETCH, START, LOAD, DONE, LEFT = range(7)  # kinds (LEFT: step is the worker that left)
NO_LR, NO_CLIP = math.nan, -1.0  # "the optimizer's own lr", "the run's grad_clip"
# A reply's norm when no update has been applied since the start or a load (a norm is never negative; NaN means the
# update was skipped, non-finite): under K > 0 the first K pulls come before any update.
NO_UPDATE_YET = -1.0
# The optimizer state a server holds (train/optim.py's FlatAdamW), by the names checkpoints give it.
STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


def _header(kind: int, step: int = 0, version: int = 0, lr: float = NO_LR, loss_scale: float = 1.0,
            clip: float = NO_CLIP, epoch: int = 0, groups: int = 0) -> torch.Tensor:
    return torch.tensor([kind, step, version, lr, loss_scale, clip, epoch, groups], dtype=torch.float64)
