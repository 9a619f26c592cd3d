"""The per-rank memory profile: at rest, peak in a step, and the formula, side by side.

Model-state bytes (parameters, gradients, optimizer state) are measured from
tensors: at rest from the storages a strategy holds between steps, at peak
from the transient tensors it reports to its MemoryLedger (gathered units,
gradient buckets, reduce-scatter outputs, autograd's gradients before they are
copied into a bucket). The formula is the memory math for the stage (docs/zero.md);
at rest the two must be equal.

The device peak covers everything else as well (activations, temporaries,
allocator slack): torch.cuda.max_memory_allocated on a GPU; on a CPU the
process's resident-set high-water mark (Linux VmHWM, reset each step through
/proc/self/clear_refs), which also counts the Python runtime and libraries.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .metrics import format_table, human_bytes, open_no_follow
from ..parallel.core.strategy import FlatStrategy
from ..parallel.core.memory_math import MEMORY_KINDS


@contextmanager
def saved_activation_bytes(model: nn.Module) -> Iterator[dict[str, int]]:
    """Inside the block, count what autograd stores for backward: each storage once (q, k and v
    are views of one tensor), the model's parameters left out. `counter["bytes"]` is the total.
    Regions that activation checkpointing recomputes store through their own hooks, so they are
    not counted: that is the saving this measures."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    counter = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            counter["bytes"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter


def allocated_peak_bytes(fn) -> int:
    """Run fn() and return the most bytes it had allocated on the CPU at any moment, net of what
    it freed: PyTorch's profiler records every allocation and free of the CPU allocator with its
    size, and the running sum of those records is the bytes allocated since fn started. Add the
    bytes alive before (e.g. the model state at rest) for the peak of live tensor bytes: the
    CPU's counterpart of cuda max_memory_allocated, without allocator slack. (The raw records,
    not the profiler's memory timeline: that analysis is deprecated and intermittently fails an
    internal assertion in multi-rank processes.)"""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    held = peak = 0
    for record in records:
        held += record.nbytes()  # negative for a free
        peak = max(peak, held)
    return peak


def device_peak_source(device: torch.device) -> str:
    return "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS (VmHWM)"


class DevicePeak:
    """The device's peak memory since the last reset(): CUDA's allocator counter on a GPU, the process's peak
    RSS (VmHWM) on the CPU. On Linux the /proc files stay open between steps (opening one costs more than
    reading it) until close(); reading 0 where the platform cannot tell."""

    def __init__(self, device: torch.device):
        self.device = device
        self._files: dict[str, int] = {}  # /proc/self file -> an open descriptor
        self._pid = os.getpid()  # a forked child's /proc/self is another file: it opens its own

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:  # "5" resets the peak RSS of this process (Linux >= 4.0)
            os.write(self._proc_file("clear_refs", os.O_WRONLY), b"5")
        except OSError:
            pass

    def bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        try:
            status = os.pread(self._proc_file("status", os.O_RDONLY), 1 << 16, 0)
        except OSError:
            return 0
        at = status.find(b"VmHWM:")
        return 0 if at < 0 else int(status[at + 6:status.index(b"kB", at)]) * 1024

    def close(self) -> None:
        if os.getpid() == self._pid:
            for fd in self._files.values():
                os.close(fd)
        self._files.clear()

    def __enter__(self) -> DevicePeak:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def _proc_file(self, name: str, flags: int) -> int:
        if os.getpid() != self._pid:  # forked since: the parent's descriptors read the parent's /proc/self
            self._files, self._pid = {}, os.getpid()
        if name not in self._files:
            self._files[name] = os.open(f"/proc/self/{name}", flags)
        return self._files[name]


def per_rank_expectation(strategy: FlatStrategy) -> list[float]:
    """This rank's [padded P, expected bytes at rest per kind]: under tensor or pipeline parallelism each rank
    holds its own slice or stage, so P differs between ranks (gather it with Comm.gather_rows)."""
    expected = strategy.expected_memory_bytes()
    return [float(strategy.flat.padded_numel)] + [float(expected[k]) for k in MEMORY_KINDS]


def profile(strategy: FlatStrategy, records: list, device: torch.device, expectations: torch.Tensor) -> dict:
    """The memory report of a run from its step records (per-rank lists gathered every step) and every
    rank's per_rank_expectation (one row each)."""
    n = len(records[-1].memory["params"])  # every rank (data-parallel replicas x tensor/pipeline slices)
    ranks = []
    for r in range(n):
        at_rest = {k: records[-1].memory[k][r] for k in MEMORY_KINDS}
        expected = {k: int(expectations[r, 1 + i]) for i, k in enumerate(MEMORY_KINDS)}
        peak = {k: max(rec.memory_peak[k][r] for rec in records) for k in (*MEMORY_KINDS, "total")}
        ranks.append({"rank": r, "padded_params": int(expectations[r, 0]), "at_rest": at_rest,
                      "expected_at_rest": expected, "at_rest_equals_formula": at_rest == expected,
                      "peak_in_step": peak,
                      "device_peak_bytes": max(rec.memory_peak["device"][r] for rec in records)})
    flat = strategy.flat
    return {
        "stage": strategy.stage, "strategy": strategy.name, "world_size": n, "dp": strategy.comm.world_size,
        "dtype": str(flat.dtype).removeprefix("torch."), "element_sizes": strategy.element_sizes(),
        "master_dtype": str(strategy.optimizer.master.dtype).removeprefix("torch."),
        "master_is_params": strategy.master_is_params,
        # Rank 0's model (with tensor or pipeline parallelism, each rank's P is in its row).
        "params": flat.numel, "padded_params": flat.padded_numel, "padding": flat.padding,
        "units": [{"name": u.name, "padded_numel": u.stop - u.start} for u in flat.units],
        "formula": strategy.memory_formula(), "expected_at_rest": strategy.expected_memory_bytes(),
        "device_peak_source": device_peak_source(device), "ranks": ranks,
        "off_device": off_device(strategy.pcfg.offload, strategy.stage),
    }


def off_device(offload: str, stage: int) -> dict[str, str]:
    """The kinds of model state that offload keeps off the device, and where: the optimizer's master and state in
    host memory (cpu) or files (disk), at ZeRO-2/3 the gradient shard in host memory (parallel/core/config.py)."""
    if offload == "none":
        return {}
    return {"optimizer": "host" if offload == "cpu" else "disk", **({"grads": "host"} if stage >= 2 else {})}


def render(report: dict) -> str:
    P = report["padded_params"]
    rows, away = [], report.get("off_device", {})
    for rank in report["ranks"]:
        for k in MEMORY_KINDS:
            got, want = rank["at_rest"][k], rank["expected_at_rest"][k]
            rows.append([rank["rank"], k if k not in away else f"{k} ({away[k]})", got,
                         f"{report['formula'][k]} = {want}", "yes" if got == want else "NO", rank["peak_in_step"][k]])
        # Offloaded kinds are not the device's: its total leaves them out (at rest, and from the step's peak).
        elsewhere = sum(rank["at_rest"][k] for k in away)
        rows.append([rank["rank"], "total" if not away else "total on the device",
                     sum(rank["at_rest"].values()) - elsewhere, "", "",
                     f"{rank['peak_in_step']['total'] - elsewhere}  (device {human_bytes(rank['device_peak_bytes'])})"])
    E = report["element_sizes"]
    sizes = sorted({rank["padded_params"] for rank in report["ranks"]})
    model = (f"P = {P} padded params ({report['params']} + {report['padding']} padding over {len(report['units'])} "
             "units)" if sizes == [P] else f"P = the padded params each rank holds ({', '.join(map(str, sizes))})")
    head = (f"Memory per rank, bytes: ZeRO-{report['stage']}, N = {report['dp']} data-parallel ranks, {model}; "
            f"bytes per element: params "
            f"{E['params']} ({report['dtype']}), grads {E['grads']}, optimizer {E['optimizer']} "
            f"({report['master_dtype']})")
    master = "; the optimizer's master is the parameter shard itself" if report["master_is_params"] else ""
    note = (f"optimizer = master + Adam m + v{master}\n"
            f"peak = most model-state bytes held at any moment of a step (gathered units, gradient buckets); "
            f"device = {report['device_peak_source']}, which includes activations and the runtime")
    return "\n".join([head, format_table(["rank", "kind", "at rest", "formula", "match", "peak in step"], rows,
                                         "><><<<"), note])


def write(report: dict, path: str | Path) -> None:
    with open_no_follow(Path(path), "w") as f:
        f.write(json.dumps(report, indent=1) + "\n")
