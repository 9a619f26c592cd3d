"""Saving a checkpoint: every rank writes its shard, rank 0 the manifest, `latest` moves last."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..parallel.core.strategy import FlatStrategy
from ..parallel.state.placement import dtype_name
from ..parallel.state.slices import gather_slices
from ..runtime.topology import Topology
from .files import _fsync_dir, _fsync_file, _write_durably, rng_state, sha256_of
from .format import (FORMAT, LATEST, MANIFEST, MANIFEST_SHA, WRITTEN_BY, CheckpointError, shard_file_name,
                     step_dir_name, written_by)


# --- save -------------------------------------------------------------------------------
# A save has three phases. begin (collective): rank 0 makes the temporary directory. write
# (local, may run in a background thread): this rank's shard file, fsynced, and its size and
# sha256. commit (collective): every rank's outcome gathered; rank 0 writes the manifest and
# renames the directory into place, then moves `latest`. A failed write on any rank makes
# commit raise on every rank, and nothing is renamed.
class PeerSaveError(CheckpointError):
    """Another rank's part of a save failed (that rank reports the cause)."""

    caused_by_peer = True  # the launcher shows the failing rank's error first


def model_entries(strategy: FlatStrategy, topo: Topology) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """(the manifest's entry for every key of this rank's model state_dict: {"key", "param": trainable parameter}
    or {"key", "tensor": stored name}, with the whole model's "shape" and "dtype"; the tensors this rank stores).
    By the placement rule (parallel/state/placement.py): frozen parameters and persistent buffers are stored whole as
    `model.<key>`, once per tied group, by the first data- and tensor-parallel rank of each stage; a
    tensor-parallel slice is gathered over its group first (collective over tp, on the first replica)."""
    values = strategy.model.state_dict(keep_vars=True)
    entries, tensors = [], {}
    for p in strategy.placements():
        entry = {"key": p.key, "shape": list(p.shape), "dtype": dtype_name(p.dtype)}
        if p.kind == "param":
            entry["param"] = p.source
        else:
            entry["tensor"] = f"model.{p.source}"
            if p.stored and topo.dp.rank == 0:
                value = values[p.key].detach()
                if p.tp_slice is not None:
                    value = gather_slices(value, p.tp_slice, topo.tp)
                if topo.tp.rank == 0:
                    tensors[entry["tensor"]] = value
        entries.append(entry)
    return entries, tensors


def host_snapshot(pieces: dict[str, list[torch.Tensor]], copy: bool,
                  scratch: Callable[[str, int, torch.dtype], torch.Tensor | None] | None = None
                  ) -> tuple[dict[str, torch.Tensor], object]:
    """Each key's pieces laid end to end, in host memory, and an event that fires once a device's copies have
    arrived (None if nothing came from a device). From a GPU the pieces go straight into pinned host memory with
    non-blocking copies queued on the stream (the step is not held up, and no second copy of the state is made on
    the device; the stream's order keeps the next step from changing them first). Host pieces are copied only
    with `copy` (a background write, while training goes on changing them); else a lone piece is used as it is,
    unless another key's tensor shares its memory (the parameters are the master at ZeRO-3), which safetensors
    refuses to write twice. `scratch(key, numel, dtype)`, where given, says where a host copy goes (disk offload:
    a file of its own, so a snapshot of state that does not fit in memory needs none; None: host memory)."""
    out, device_copies, used = {}, False, set()
    for key, parts in pieces.items():
        first = parts[0]
        storage = first.untyped_storage().data_ptr()
        if (first.device.type == "cpu" and not copy and len(parts) == 1 and first.is_contiguous()
                and storage not in used):
            out[key] = first.detach()
            used.add(storage)
            continue
        pinned = first.device.type == "cuda"
        shape = first.shape if len(parts) == 1 else (sum(p.numel() for p in parts),)
        host = None if scratch is None else scratch(key, math.prod(shape), first.dtype)
        if host is None:
            host = torch.empty(shape, dtype=first.dtype, pin_memory=pinned)
        else:  # a file's pages: the device's copies into them are not queued but done here
            pinned = False
        device_copies |= pinned
        host = host.view(shape)
        flat, at = host.view(-1), 0
        for part in parts:
            flat[at:at + part.numel()].copy_(part.detach().reshape(-1), non_blocking=pinned)
            at += part.numel()
        out[key] = host
    if not device_copies:
        return out, None
    arrived = torch.cuda.Event()
    arrived.record()
    return out, arrived


def all_finite(t: torch.Tensor, block: int = 1 << 18) -> bool:
    """No NaN or Inf in t, checked a block at a time: isfinite makes temporaries of its input's size (|x|, masks),
    so a whole state is never copied for it."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + block]).all()) for i in range(0, flat.numel(), block))


class ShardWrite:
    """One rank's part of one save: the snapshot to write and, once written, its outcome."""

    def __init__(self, root: Path, step: int, topo: Topology, strategy: FlatStrategy, train_state: dict,
                 run_config: dict, copy: bool, after_written: Callable[[int], None] | None = None,
                 sharing: list[int] | None = None):
        """sharing: begin's sharing_ranks (default: one directory for every rank)."""
        self.root, self.step, self.topo, self.strategy = root, step, topo, strategy
        self.sharing = [list(range(topo.world_size))] * topo.world_size if sharing is None else sharing
        self.train_state, self.run_config, self.after_written = train_state, run_config, after_written
        self.final, self.tmp = root / step_dir_name(step), root / f".tmp-{step_dir_name(step)}"
        self.path = self.tmp / shard_file_name(topo.rank)
        # A background write needs a copy: training goes on changing the live buffers.
        self.state_dict_map, extras = model_entries(strategy, topo)
        store = self._store = strategy.optimizer.store  # offloaded to disk, a copy of the state goes to files too
        shards, self._arrived = host_snapshot({**strategy.state_pieces(), **{k: [v] for k, v in extras.items()}},
                                              copy, None if store is None else store.scratch)
        self.shards = {**shards, **rng_state()}
        self.keys = list(self.shards)
        # The flat vectors this rank's file holds and their dtypes: ranks may differ (a rank whose shard is all
        # padding still stores its vectors; a user's optimizer may keep state in some parameter groups only).
        self.flat_dtypes = {key: dtype_name(t.dtype) for key, t in shards.items()
                            if key.startswith(("params", "optim."))}
        self.row: list[int] | None = None  # [bytes, sha256 as 4 int64 words] once written
        self.error: str | None = None

    def write(self) -> None:
        """Write, fsync, hash. Never raises: the outcome is exchanged at commit."""
        try:
            if self._arrived is not None:  # the device's copies into host memory, queued by the snapshot
                self._arrived.synchronize()
            # A NaN or Inf in the parameters or the optimizer's state would resume nothing: such a save fails
            # (on every rank, at commit) rather than become the checkpoint `latest` names. Buffers may hold
            # infinities on purpose (a -inf attention mask), so only the flat state is checked.
            bad = next((key for key, t in self.shards.items() if key.startswith(("params", "optim."))
                        and t.is_floating_point() and not all_finite(t)), None)
            if bad is not None:
                raise ValueError(f"'{bad}' holds NaN or Inf values; a checkpoint of them would resume nothing "
                                 "(lower --lr, or resume from an earlier checkpoint)")
            # The header says whose shard this is: a file moved to another rank's name (even with its sha256
            # updated in the manifest) is refused by schema.check_shard_header. One key: safetensors writes
            # metadata in hash order, and two keys would make equal saves differ byte for byte.
            save_file(self.shards, str(self.path), metadata={WRITTEN_BY: written_by(self.topo.rank, self.step)})
            _fsync_file(self.path)
            if self.after_written is not None:
                self.after_written(self.step)
            digest = bytes.fromhex(sha256_of(self.path))
            self.row = [self.path.stat().st_size] + [int.from_bytes(digest[i:i + 8], "big", signed=True)
                                                     for i in range(0, 32, 8)]
        except Exception as e:  # noqa: BLE001 - a disk error is reported by commit, on every rank
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.shards = {}  # the snapshot's memory goes back as soon as it is on disk
            if self._store is not None:  # and offloaded state read for the write goes back to its files
                self._store.release()

    @property
    def written(self) -> bool:
        return self.row is not None or self.error is not None


def sharing_ranks(directory: Path, topo: Topology) -> list[list[int]]:
    """Collective: for every rank, the ranks for which `directory` is that rank's own (the same filesystem), found by
    each rank leaving a mark in it: all of them on a shared filesystem; a machine's ranks where each machine has a
    disk of its own (a cluster without a shared OUT). The same answer on every rank, so that every rank takes the
    same branch after it."""
    directory.mkdir(parents=True, exist_ok=True)
    # Marks of this call only: a directory left by a crashed run may hold older ones.
    [token] = topo.everyone.gather_json(uuid.uuid4().hex[:12] if topo.is_main else None)[:1]
    mark = directory / f".rank-{topo.rank}-{token}"
    mark.touch()
    topo.everyone.barrier()
    mine = sorted(int(p.name.split("-")[1]) for p in directory.glob(f".rank-*-{token}"))
    everyone = topo.everyone.gather_json(mine)  # every rank has looked before any mark goes
    mark.unlink()
    return everyone


def shared_by_all(sharing: list[list[int]]) -> bool:
    """sharing_ranks found one directory for every rank."""
    return all(len(ranks) == len(sharing) for ranks in sharing)


def begin(root: str | os.PathLike, step: int, topo: Topology) -> list[list[int]]:
    """Collective: rank 0 sweeps crashed saves' leftovers and makes this save's temporary directory; where OUT is
    not shared (each machine its own disk), each machine's ranks make one on theirs, and its first rank sweeps that
    machine's leftovers. Returns sharing_ranks of the temporary directory."""
    root = Path(root)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if topo.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):  # left by saves that crashed: never checkpoints
            shutil.rmtree(stale, ignore_errors=True)
        for moved in root.glob(".old-step-*"):
            _settle_moved_aside(root, moved)
        tmp.mkdir()
    topo.everyone.barrier()
    if not tmp.is_dir():  # another machine's disk: this save's directory there
        tmp.mkdir(parents=True, exist_ok=True)
    sharing = sharing_ranks(tmp, topo)
    mine = sharing[topo.rank]
    if 0 not in mine and topo.rank == min(mine):  # that machine's leftovers
        for stale in root.glob(".tmp-step-*"):
            if stale.name != tmp.name:
                shutil.rmtree(stale, ignore_errors=True)
        for moved in root.glob(".old-step-*"):
            _settle_moved_aside(root, moved)
    return sharing


def commit(job: ShardWrite) -> Path:
    """Collective: agree on every rank's outcome; if all wrote, make the checkpoint complete and
    point `latest` at it. Returns the final step directory; raises CheckpointError on every rank
    if any rank's write failed (the temporary directory stays, and is swept by the next save)."""
    topo = job.topo
    row = torch.tensor([0 if job.error is None else 1] + (job.row or [0] * 5), dtype=torch.int64)
    rows = topo.everyone.gather_rows(row).tolist()
    # Which logical pieces each rank's file holds: only the rank knows its own (a pipeline stage's
    # parameters are its own), so each says, and rank 0 writes them all into the manifest.
    ranges = job.strategy.checkpoint_ranges(topo.dp.rank)
    pieces = job.strategy.flat.pieces(ranges) if ranges else []
    held = topo.everyone.gather_ragged([sum(b - a for a, b in ranges)] + [v for piece in pieces for v in piece])
    # The whole model's parameters and state_dict keys: each rank knows those of its own part.
    flat = job.strategy.flat
    described = topo.everyone.gather_json({
        "segments": [[s.name, s.logical, list(s.full_shape or s.shape)] for s in flat.segments],
        "state_dict": job.state_dict_map, "flat_dtypes": job.flat_dtypes})
    failed = [rank for rank, r in enumerate(rows) if r[0]]
    if failed:
        where = f"step {job.step}: writing {job.path}"
        if job.error is not None:
            raise CheckpointError(f"{where} failed on rank {topo.rank}: {job.error}; `latest` still names the "
                                  "previous checkpoint")
        raise PeerSaveError(f"step {job.step}: checkpoint not saved: rank(s) {failed} could not write their shard")
    text = None
    if topo.is_main:
        text = json.dumps(_manifest(job.step, topo, job.strategy, job.train_state, job.run_config, job.keys,
                                    [r[1:] for r in rows], held, described), indent=1)
        _complete(job, text)
    if not shared_by_all(job.sharing):
        # Each machine its own disk: the manifest goes to every machine, whose copy holds its own ranks' files
        # (whole only in the store: --ckpt.dir, remote.upload_collectively).
        [text] = topo.everyone.gather_json(text)[:1]
        mine = job.sharing[topo.rank]
        if 0 not in mine and topo.rank == min(mine):
            _complete(job, text)  # `latest` too: keep_last there must not take it for an abandoned line
    topo.everyone.barrier()
    return job.final


def _complete(job: ShardWrite, text: str) -> None:
    """Write the manifest into the temporary directory, rename it into place and point `latest` at it."""
    root, final, tmp = job.root, job.final, job.tmp
    (tmp / MANIFEST).write_text(text)
    _fsync_file(tmp / MANIFEST)
    (tmp / MANIFEST_SHA).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")
    _fsync_file(tmp / MANIFEST_SHA)
    _fsync_dir(tmp)
    old = _move_aside(root, final) if final.exists() else None
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_durably(root / LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old)


def save(root: str | os.PathLike, step: int, topo: Topology, strategy: FlatStrategy,
         train_state: dict, run_config: dict, after_written: Callable[[int], None] | None = None) -> Path:
    """Collective: every rank calls it. Returns the final step directory."""
    sharing = begin(root, step, topo)
    job = ShardWrite(Path(root), step, topo, strategy, train_state, run_config, copy=False,
                     after_written=after_written, sharing=sharing)
    job.write()
    return commit(job)


class AsyncSave:
    """A save whose file writes run in a background thread from a CPU snapshot of the shards.
    `begin` and the snapshot happen at construction (collective); `commit()` (collective) waits for
    the write, and only then is the checkpoint renamed into place and `latest` moved."""

    def __init__(self, root: str | os.PathLike, step: int, topo: Topology, strategy: FlatStrategy,
                 train_state: dict, run_config: dict, after_written: Callable[[int], None] | None = None):
        sharing = begin(root, step, topo)
        self.job = ShardWrite(Path(root), step, topo, strategy, train_state, run_config, copy=True,
                              after_written=after_written, sharing=sharing)
        self._thread = threading.Thread(target=self.job.write, name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    @property
    def written(self) -> bool:
        """This rank's file is written (or failed): commit would not wait."""
        return self.job.written

    def commit(self) -> Path:
        self._thread.join()
        return commit(self.job)


def _move_aside(root: Path, final: Path) -> Path:
    """Re-saving a step that exists (a resumed run passing it again): move the old copy
    aside. Directories cannot be swapped atomically, so if `latest` names this step it is
    pointed at the old copy until the new one is in place: it always names a complete one."""
    old = root / f".old-{final.name}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    _fsync_dir(root)
    if (root / LATEST).exists() and (root / LATEST).read_text().strip() == final.name:
        _write_durably(root / LATEST, old.name + "\n")
    return old


def _settle_moved_aside(root: Path, old: Path) -> None:
    """A re-save interrupted after _move_aside left `old` (.old-step-N), and maybe `latest` naming it. If the new
    copy was renamed into place, it is complete: `latest` goes back to it and the old copy is removed. If not, the
    old copy is the only one: it returns to its name."""
    final = root / old.name.removeprefix(".old-")
    if not final.exists():
        os.replace(old, final)
        _fsync_dir(root)
    if (root / LATEST).exists() and (root / LATEST).read_text().strip() == old.name:
        _write_durably(root / LATEST, final.name + "\n")
    shutil.rmtree(old, ignore_errors=True)


def _manifest(step, topo, strategy, train_state, run_config, keys, rows, held, described) -> dict:
    """rows: each rank's [file bytes, sha256 words]; held: each rank's [length of its stored vectors,
    then its pieces' at, lo, hi, ...] (empty pieces: it stores none); described: each rank's segments,
    state_dict map (model_entries) and the flat vectors its file holds, with their dtypes."""
    flat = strategy.flat
    files, tensors = [], []
    for rank, (size, *digest_words) in enumerate(rows):
        name = shard_file_name(rank)
        digest = b"".join(w.to_bytes(8, "big", signed=True) for w in digest_words).hex()
        files.append({"name": name, "rank": rank, "bytes": size, "sha256": digest})
        local, *flat_pieces = held[rank]
        pieces = [flat_pieces[i:i + 3] for i in range(0, len(flat_pieces), 3)]  # none: the rank holds padding only
        # Parameters in their dtype, optimizer state in the master's (they differ in mixed precision).
        tensors += [{"key": key, "file": name, "dtype": dtype, "shape": [local], "pieces": pieces}
                    for key, dtype in described[rank]["flat_dtypes"].items()]
        tensors += [{"key": key, "file": name, "rank": rank} for key in keys if key.startswith("rng.")]
    segments, state_dict, stored = {}, {}, {}
    for rank, part in enumerate(described):
        for seg_name, offset, shape in part["segments"]:
            segments.setdefault(seg_name, {"name": seg_name, "offset": offset, "shape": shape})
        for entry in part["state_dict"]:
            state_dict.setdefault(entry["key"], entry)
            if "tensor" in entry and rank == _extras_writer(topo, rank):
                stored.setdefault(entry["tensor"], shard_file_name(rank))
    tensors += [{"key": key, "file": file} for key, file in stored.items()]
    return {
        "format": FORMAT,
        "step": step,
        "world_size": topo.world_size,
        "layout": topo.layout(),
        "strategy": strategy.name,
        "zero": strategy.stage,
        "model": run_config.get("model"),
        # The whole model's logical vector. Padding and units are rank 0's (with pipeline stages, its stage's).
        "flat": {"numel": flat.logical_numel, "padded_numel": flat.padded_numel, "padding": flat.padding,
                 "segments": sorted(segments.values(), key=lambda s: s["offset"]),
                 "units": [{"name": u.name, "padded_numel": u.stop - u.start} for u in flat.units]},
        "state_dict": list(state_dict.values()),
        "files": files,
        "tensors": tensors,
        "train_state": train_state,
        "config": run_config,
    }


def _extras_writer(topo: Topology, rank: int) -> int:
    """The rank that stores `rank`'s stage's frozen parameters and buffers: its stage's first replica and
    tensor-parallel rank (layout: rank = (pp_rank * dp + dp_rank) * tp + tp_rank)."""
    per_stage = topo.dp.world_size * topo.tp.world_size * topo.ep.world_size
    return rank // per_stage * per_stage
