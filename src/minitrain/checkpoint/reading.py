"""Loading a checkpoint: each rank reads, from whichever files hold them, only the pieces it holds."""
from __future__ import annotations

import os
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Mapping
from itertools import accumulate
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..parallel.core.strategy import FlatStrategy
from ..parallel.state.placement import Placement, dtype_name
from ..runtime.topology import Topology
from .files import CUDA_RNG, RNG_KEYS, read_manifest, read_tensor, resolve, set_rng_state, verify_files
from .format import CheckpointError, shard_file_name

# --- load -------------------------------------------------------------------------------
def assemble_flat(step_dir: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """Every flat vector (params, optimizer state) as one full logical tensor,
    put together from the pieces in whichever files hold them."""
    numel = manifest["flat"]["numel"]
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}  # which logical elements some piece filled
    for t in manifest["tensors"]:
        if "pieces" not in t:
            continue
        value = read_tensor(step_dir / t["file"], t["key"])
        dest = full.setdefault(t["key"], torch.zeros(numel, dtype=value.dtype))
        for at, lo, hi in t["pieces"]:
            if not (0 <= lo < hi <= numel and 0 <= at and at + hi - lo <= value.numel()):
                raise CheckpointError(f"checkpoint {step_dir}: piece {[at, lo, hi]} of '{t['key']}' in {t['file']} "
                                      "lies outside the tensor or the parameter vector")
            dest[lo:hi].copy_(value[at:at + hi - lo])
            covered.setdefault(t["key"], torch.zeros(numel, dtype=torch.bool))[lo:hi] = True
    for key, mask in covered.items():
        if not mask.all():
            raise CheckpointError(f"checkpoint {step_dir} covers {int(mask.sum())} of {numel} elements of '{key}'")
    return full


def plan_reads(manifest: dict, key: str, wanted: list[list[int]]) -> dict[str, list[tuple[int, int, int]]]:
    """Where to read a local vector's elements from: {file: [(at in the stored tensor, at in the local vector,
    count), ...]} for the wanted pieces [at, lo, hi] (local elements [at, at + hi - lo) are logical [lo, hi))."""
    stored = sorted((lo, hi, at, t["file"]) for t in manifest["tensors"] if t["key"] == key
                    for at, lo, hi in t.get("pieces", []))
    reach = list(accumulate((p[1] for p in stored), max))  # the furthest any piece so far extends
    reads: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for want_at, want_lo, want_hi in wanted:
        i = bisect_right(reach, want_lo)  # the first stored piece that may extend past want_lo
        while i < len(stored) and stored[i][0] < want_hi:
            lo, hi, at, file = stored[i]
            a, b = max(lo, want_lo), min(hi, want_hi)
            if a < b:
                reads[file].append((at + a - lo, want_at + a - want_lo, b - a))
            i += 1
    return reads


READ_BLOCK = 1 << 22  # elements read from a file at once: a piece as large as a whole state is not read whole


def read_local(step_dir: Path, manifest: dict, key: str, reads: dict[str, list[tuple[int, int, int]]],
               wanted: list[list[int]], length: int,
               scratch: Callable[[str, int, torch.dtype], torch.Tensor | None] | None = None) -> torch.Tensor:
    """This rank's local vector of `key` (params, optim.*), read piece by piece as `reads` (plan_reads) says:
    only the elements it holds are read, a block at a time. Padding stays zero; an uncovered element is an error.
    `scratch(key, numel, dtype)`, where given, says where the vector goes (disk offload: a file of its own; None:
    host memory)."""
    entry = next(t for t in manifest["tensors"] if t["key"] == key)
    dtype = getattr(torch, entry["dtype"])
    out = None if scratch is None else scratch(key, length, dtype)
    out = torch.zeros(length, dtype=dtype) if out is None else out
    covered: list[tuple[int, int]] = []
    for file, copies in reads.items():
        try:
            with safe_open(str(step_dir / file), framework="pt") as f:
                stored = f.get_slice(key)
                size = stored.get_shape()[0]
                for at, local_at, n in copies:
                    if at + n > size:
                        raise CheckpointError(f"checkpoint {step_dir}: a piece of '{key}' lies outside {file}")
                    for i in range(0, n, READ_BLOCK):
                        m = min(READ_BLOCK, n - i)
                        out[local_at + i:local_at + i + m] = stored[at + i:at + i + m]
                    covered.append((local_at, local_at + n))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read '{key}' from {step_dir / file}: {e}") from None
    needed, filled = sum(hi - lo for _, lo, hi in wanted), _union_length(covered)
    if filled != needed:
        raise CheckpointError(f"checkpoint {step_dir} covers {filled} of the {needed} elements of "
                              f"'{key}' this rank holds")
    return out


def _union_length(intervals: list[tuple[int, int]]) -> int:
    """How many elements the [start, stop) intervals cover together (overlaps once)."""
    total, reach = 0, None
    for start, stop in sorted(intervals):
        if reach is None or start >= reach:
            total, reach = total + stop - start, stop
        elif stop > reach:
            total, reach = total + stop - reach, stop
    return total


class ReadWhenAsked(Mapping):
    """A rank's local vectors by name, each read from the checkpoint when asked for and not kept: a load holds one
    at a time (with offloaded state, never the whole state in memory)."""

    def __init__(self, names: list[str], read: Callable[[str], torch.Tensor]):
        self._names, self._read = list(names), read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name) -> bool:  # Mapping's would read the vector to find out
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _check_same_model(step_dir: Path, manifest: dict, strategy: FlatStrategy) -> None:
    """This rank's parameters (all of them, a pipeline stage's, tensor-parallel slices) must be the whole
    model's, where the checkpoint has them."""
    theirs = {s["name"]: (s["shape"], s["offset"]) for s in manifest["flat"]["segments"]}
    diff = next((f"{s.name} {list(s.full_shape or s.shape)} at {s.logical} vs {theirs.get(s.name, 'absent')}"
                 for s in strategy.flat.segments if theirs.get(s.name) != (list(s.full_shape or s.shape), s.logical)),
                None)
    if diff is None and manifest["flat"]["numel"] != strategy.flat.logical_numel:
        diff = f"{strategy.flat.logical_numel} vs {manifest['flat']['numel']} trainable parameters"
    if diff is not None:
        raise CheckpointError(f"checkpoint {step_dir} holds a different model (this run vs checkpoint: {diff})")


def _check_entries(step_dir: Path, stored: dict[str, dict], mine: list[Placement], whole: list[str]) -> None:
    """The checkpoint holds exactly the whole model's keys (`whole`); every key of this rank's part is of the same
    kind, whole shape and dtype."""
    extra = [key for key in stored if key not in set(whole)]
    if extra:
        raise CheckpointError(f"checkpoint {step_dir} holds '{extra[0]}', which this model's state_dict has not"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")
    absent = [p.key for p in mine if p.key not in stored]
    if absent:
        raise CheckpointError(f"checkpoint {step_dir} has no entry for {', '.join(absent[:5])}"
                              f"{' ...' if len(absent) > 5 else ''} of this model's state_dict")
    for p in mine:
        entry = stored[p.key]
        if ("param" in entry) != (p.kind == "param"):
            was, now = ("trainable", "frozen or a buffer") if "param" in entry else ("frozen or a buffer", "trainable")
            raise CheckpointError(f"checkpoint {step_dir}: '{p.key}' was {was} when saved and is {now} in this model")
        if entry["shape"] != list(p.shape) or entry["dtype"] != dtype_name(p.dtype):
            raise CheckpointError(f"checkpoint {step_dir}: '{p.key}' is {entry['shape']} {entry['dtype']} there, "
                                  f"{list(p.shape)} {dtype_name(p.dtype)} in this model")


def load(path: str | os.PathLike, topo: Topology, strategy: FlatStrategy) -> dict:
    """Verify the files this rank reads, then restore its parameters, optimizer state, frozen parameters and
    buffers and (same world size) its RNG, reading only what it holds. Collective at ZeRO-1/2 (the full
    parameters are gathered from the shards). Returns the saved training state (step, loader position, ...)."""
    step_dir = resolve(path)
    manifest = read_manifest(step_dir)
    _check_same_model(step_dir, manifest, strategy)
    flat = strategy.flat
    wanted = flat.pieces(strategy.shard_ranges)
    length = sum(b - a for a, b in strategy.shard_ranges)
    keys = sorted({t["key"] for t in manifest["tensors"] if "pieces" in t})
    flat_dtypes = {"params": flat.dtype, "optim.master": strategy.optimizer.master.dtype}
    stored = {m["key"]: m for m in manifest["state_dict"]}
    mine = strategy.placements()
    _check_entries(step_dir, stored, mine, list(strategy.whole.state))
    extras = [p for p in mine if p.kind != "param" and p.stored]  # a tied group's tensor once
    reads = {key: plan_reads(manifest, key, wanted) for key in keys}
    files = {file for per_key in reads.values() for file in per_key}
    extra_files = {t["key"]: t["file"] for t in manifest["tensors"] if t["key"].startswith("model.")}
    files |= {extra_files[stored[p.key]["tensor"]] for p in extras if stored[p.key]["tensor"] in extra_files}
    same_world = manifest["world_size"] == topo.world_size
    if same_world:
        files.add(shard_file_name(topo.rank))
    verify_files(step_dir, manifest, files)
    for key, dtype in flat_dtypes.items():
        theirs = next((t["dtype"] for t in manifest["tensors"] if t["key"] == key), None)
        if theirs != dtype_name(dtype):
            raise CheckpointError(f"checkpoint {step_dir} stores {key} in {theirs}, this run keeps them in "
                                  f"{dtype_name(dtype)} (resume with the dtype and precision it "
                                  "was saved with)")
    store = strategy.optimizer.store  # offloaded to disk, what is read goes to files too

    def read(key: str) -> torch.Tensor:
        return read_local(step_dir, manifest, key, reads[key], wanted, length, None if store is None else store.scratch)

    train_state = manifest["train_state"]
    optimizer_state = ReadWhenAsked([k.removeprefix("optim.") for k in keys if k.startswith("optim.")],
                                    lambda name: read(f"optim.{name}"))
    strategy.load_local(read("params"), optimizer_state, train_state["optimizer_scalars"])
    values = strategy.model.state_dict(keep_vars=True)
    with torch.no_grad():
        for p in extras:
            name = stored[p.key]["tensor"]
            if name not in extra_files:
                raise CheckpointError(f"checkpoint {step_dir} has no tensor for '{p.key}'")
            saved = read_tensor(step_dir / extra_files[name], name)
            if list(saved.shape) != list(p.shape) or saved.dtype != p.dtype:
                raise CheckpointError(f"checkpoint {step_dir}: '{p.key}' is stored as {list(saved.shape)} "
                                      f"{dtype_name(saved.dtype)}, the model's is {list(p.shape)} "
                                      f"{dtype_name(p.dtype)}")
            if p.tp_slice is not None:  # this rank's tensor-parallel slice of the whole tensor
                saved = saved.index_select(p.tp_slice.dim, p.tp_slice.index)
            values[p.key].copy_(saved)  # in place: the tensor keeps its device, and a tied one stays tied
    if same_world:  # each rank continues its own random streams
        shard = step_dir / shard_file_name(topo.rank)
        saved = {t["key"] for t in manifest["tensors"] if t["file"] == shard_file_name(topo.rank)}
        set_rng_state({key: read_tensor(shard, key) for key in (*RNG_KEYS, CUDA_RNG) if key in saved})
    return train_state
