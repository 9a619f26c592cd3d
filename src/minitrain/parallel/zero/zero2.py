"""ZeRO-2 with the full parameters whole all the time, in one flat buffer (DeepSpeed's stage 2): optimizer state
and gradients sharded (gradient_shard.py), parameters gathered whole after every update.

make_strategy (parallel/__init__.py) uses it where ZeRO-2 cannot free each unit after backward
(sharded_units.py with reshard_after_forward=False):
  - in mixed precision or offloaded, where the master is float32 or on the host: gathering units from the shard
    would need a 16-bit copy of it on the device (2P/N bytes; on one GPU, the whole model again);
  - in a user's own loop (prepare()), whose code between loss.backward() and optimizer.step() may read a
    parameter: a freed one's storage cannot be read (it crashes the process rather than raising).
Everything it does is ShardedStrategy's; this class only names the stage.
"""
from __future__ import annotations

from .sharded import ShardedStrategy


class Zero2(ShardedStrategy):
    name = "zero2"
    stage = 2
