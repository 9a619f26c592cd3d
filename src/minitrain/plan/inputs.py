"""What a plan is asked about (PlanInput: a model or a raw parameter count, a layout, a precision, a machine),
and the sizes every part of the plan derives from it: P as the strategy lays it out, the ranks it is sharded
over, the bytes of an element."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import ModelConfig
from ..models.size import model_units
from ..parallel.core.memory_math import padded_numel
from .hardware import PRESETS, Hardware


@dataclass
class PlanInput:
    model: ModelConfig | None  # None with a raw parameter count
    params: float  # parameter count (exact for a model config)
    seq_len: int = 1024  # tokens per example when only a parameter count is given
    micro_batch: int = 1
    grad_accum: int = 1
    precision: str = "fp32"
    reduce_dtype: str = "fp32"  # fp32 | compute: what gradients are summed in (train/precision.py)
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    activation_checkpointing: str = "none"
    microbatches: int = 1  # pipeline micro-batches per step
    schedule: str = "1f1b"
    virtual_stages: int = 1  # interleaved: chunks per pipeline rank
    offload: str = "none"  # none | cpu | disk: where the optimizer's master and state live (train/offload_files.py)
    ep: int = 1  # expert parallelism (a mixture of experts): each rank holds 1/ep of the experts; divides dp
    cp: int = 1  # context parallelism: groups of cp ranks split every sequence (world = dp x tp x pp x cp)
    cp_style: str = "ring"  # ring | ulysses
    servers: int = 0  # parameter servers besides the dp workers (servers.py); the workers hold no optimizer
    staleness: int = 0  # their bound K: what a server holds of gradients waiting for their step
    mfu: float = 0.4
    hardware: Hardware = field(default_factory=lambda: PRESETS["h100-sxm"])


def padded_params(cfg: ModelConfig, zero: int, dp: int, ep: int = 1) -> int:
    """P as the strategy lays it out: one unit at ZeRO 0-1, one per block at ZeRO 2-3, each padded to a
    multiple of the ranks it is sharded over (data parallel shards nothing and pads nothing)."""
    units = list(model_units(cfg, ep).values())
    return padded_numel(units if zero >= 2 else [sum(units)], dp if zero >= 1 else 1)


def layout_params(inp: PlanInput) -> int:
    """P: the flat size one model-parallel rank's data-parallel group shards (padded as laid out)."""
    if inp.model is not None and inp.tp == inp.pp == 1:
        return padded_params(inp.model, inp.zero, shard_ranks(inp), inp.ep)
    return math.ceil(inp.params / (inp.tp * inp.pp))


def shard_ranks(inp: PlanInput) -> int:
    """The ranks ZeRO shards over: the data-parallel ranks, under expert parallelism the replicas of one rank's
    experts (dp / ep; Topology.with_experts), under context parallelism every rank of dp x cp (with_context)."""
    return inp.dp * inp.cp // inp.ep


def local_seq(inp: PlanInput) -> int:
    """Tokens of a sequence one rank holds: all of them, or 1/cp under context parallelism."""
    return (inp.model.seq_len if inp.model is not None else inp.seq_len) // inp.cp


def element_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def reduce_bytes(inp: PlanInput) -> int:
    """Bytes per gradient element on the wire (and in ZeRO-2/3's gradient shard)."""
    return 4 if inp.reduce_dtype == "fp32" else element_bytes(inp.precision)
