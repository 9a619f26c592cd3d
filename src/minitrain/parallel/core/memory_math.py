"""The memory math of the strategies, in one place: what each ZeRO stage keeps per rank, and a ledger of
the transient model-state tensors a step creates (the planner and the memory profile use both)."""
from __future__ import annotations

import torch


MEMORY_KINDS = ("params", "grads", "optimizer")


def memory_terms(stage: int, master_is_params: bool, states: int = 2) -> dict[str, tuple[int, int]]:
    """The memory math, per kind: (tensors of P elements, tensors of P/N elements). The optimizer holds `states`
    elementwise tensors (Adam's m and v: 2; SGD's momentum: 1) plus its master, unless the master is the
    parameters themselves. Stage s shards the optimizer state (s >= 1) and gradients (s >= 2); ZeRO-3 keeps only
    the parameter shard, and ZeRO-2 the full parameters, with beside them, when it frees them after backward, the
    shard they are gathered from (zero/sharded_units.py, reshard_after_forward False). At ZeRO-2/3
    `master_is_params` means the shard is the master (counted as parameters). The strategies and the planner both
    use this one rule."""
    optimizer = states + (0 if master_is_params else 1)
    return {"params": (0, 1) if stage == 3 else (1, int(stage == 2 and master_is_params)),
            "grads": (1, 0) if stage < 2 else (0, 1),
            "optimizer": (optimizer, 0) if stage == 0 else (0, optimizer)}


def term_bytes(terms: tuple[int, int], element: int, whole: float, shard: float) -> float:
    """Bytes of one kind's terms: `whole` and `shard` elements (P and P/N) of `element` bytes each."""
    return element * (terms[0] * whole + terms[1] * shard)


def term_formula(terms: tuple[int, int], element: int) -> str:
    """'4*P + 4*P/N', '12*P/N', '0'."""
    parts = [f"{count * element}*P{suffix}" for count, suffix in zip(terms, ("", "/N")) if count]
    return " + ".join(parts) or "0"


def padded_numel(unit_sizes: list[int], world_size: int) -> int:
    """Elements in the flat buffer: every unit padded to a multiple of the world size (as laid out below)."""
    return sum(-(-size // world_size) * world_size for size in unit_sizes)


class MemoryLedger:
    """Bytes of model state (params, grads, optimizer) a rank holds, now and at its peak.

    The at-rest figures come from the tensors themselves (`FlatStrategy.memory_bytes`);
    strategies report every transient model-state tensor they create and drop during a
    step (a gathered unit, a gradient bucket, a reduce-scatter output, a gradient autograd
    allocated) with `hold`/`drop`, so the peak is measured from tensor sizes too."""

    def __init__(self):
        self.transient = dict.fromkeys(MEMORY_KINDS, 0)
        self.peak_transient = dict.fromkeys(MEMORY_KINDS, 0)
        self.peak_total_transient = 0

    def hold(self, kind: str, t: torch.Tensor) -> None:
        self.transient[kind] += t.untyped_storage().nbytes()
        self.peak_transient[kind] = max(self.peak_transient[kind], self.transient[kind])
        self.peak_total_transient = max(self.peak_total_transient, sum(self.transient.values()))

    def drop(self, kind: str, t: torch.Tensor) -> None:
        self.transient[kind] -= t.untyped_storage().nbytes()

    def reset_peak(self) -> None:
        self.peak_transient = dict(self.transient)
        self.peak_total_transient = sum(self.transient.values())
