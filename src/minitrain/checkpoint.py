"""Sharded checkpoints: safetensors shards plus a JSON manifest. Data, never pickles.

Layout of OUT/checkpoints/:
  step-000010/rank-00000.safetensors   this rank's shard of the flat vectors
  step-000010/rank-00001.safetensors   (params, optim.master, optim.exp_avg,
  ...                                   optim.exp_avg_sq) and its torch, python
                                        and numpy RNG states
  step-000010/manifest.json            step, world size, strategy, model config,
                                        parameter layout, the model's state_dict
                                        keys, every tensor's file and logical
                                        pieces, every file's bytes and sha256,
                                        training state (optimizer steps, loader)
  latest                               name of the newest complete step directory

Crash safety: every rank writes into .tmp-step-000010/ and fsyncs; rank 0
writes the manifest, fsyncs, renames the directory to its final name, and
only then rewrites `latest` (itself via rename). A directory without a
verified manifest is never loaded.

A rank stores its shard as one tensor per key; the manifest lists its
*pieces*: [at, lo, hi] says elements [at, at + hi - lo) of the stored tensor
are elements [lo, hi) of the logical vector (every trainable parameter,
unpadded, in registration order; layout in the manifest). Loading reads, by
index, only the pieces this rank holds (no rank ever assembles the whole model
or optimizer), so it depends neither on how many ranks wrote them nor on the
ZeRO stage (whose per-unit padding never reaches the file's coordinates).

Everything else in the model's state_dict (frozen parameters, persistent
buffers) is stored whole, as `model.<key>`, by the first data- and
tensor-parallel rank of each pipeline stage. The manifest's `state_dict` maps
every key of the model's own state_dict to a trainable parameter (tied weights:
two keys, one parameter) or to such a stored tensor, which is how
`ckpt consolidate` writes a file the model's load_state_dict accepts.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import threading
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .parallel.flat import FlatStrategy
from .topology import Topology

FORMAT = "minitrain-checkpoint/3"
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, corrupt or does not fit this run."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(step_dir: Path) -> int:
    """The step a step directory's name says (step-000010 -> 10)."""
    return int(step_dir.name.removeprefix("step-"))


def shard_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """Write text to path via a temporary file, fsync and rename: all or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# --- random number generators ----------------------------------------------------------------
RNG_KEYS = ("rng.torch", "rng.python", "rng.python_gauss", "rng.numpy", "rng.numpy_gauss")


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch, python and numpy generator states as tensors (safetensors holds
    nothing else). Mersenne Twister words fit int64; a cached Gaussian, if any, is a float64."""
    _, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {"rng.torch": torch.get_rng_state(),
            "rng.python": torch.tensor(words, dtype=torch.int64),
            "rng.python_gauss": torch.tensor([] if gauss is None else [gauss], dtype=torch.float64),
            "rng.numpy": torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64),
            "rng.numpy_gauss": torch.tensor([cached], dtype=torch.float64)}


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["rng.torch"])
    gauss = state["rng.python_gauss"].tolist()
    random.setstate((3, tuple(state["rng.python"].tolist()), gauss[0] if gauss else None))
    *keys, pos, has_gauss = state["rng.numpy"].tolist()
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss,
                         float(state["rng.numpy_gauss"][0])))


# --- save -------------------------------------------------------------------------------
# A save has three phases. begin (collective): rank 0 makes the temporary directory. write
# (local, may run in a background thread): this rank's shard file, fsynced, and its size and
# sha256. commit (collective): every rank's outcome gathered; rank 0 writes the manifest and
# renames the directory into place, then moves `latest`. A failed write on any rank makes
# commit raise on every rank, and nothing is renamed.
class PeerSaveError(CheckpointError):
    """Another rank's part of a save failed (that rank reports the cause)."""

    caused_by_peer = True  # the launcher shows the failing rank's error first


def model_entries(strategy: FlatStrategy) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    """(for every key of the model's state_dict: [key, "param", trainable parameter name] or [key, "tensor",
    stored name]; the tensors to store: frozen parameters and persistent buffers, as `model.<key>`)."""
    flat_names = {id(strategy.flat.param_named(n)): n for n in strategy.flat.names()}
    mapping, tensors = [], {}
    for key, value in strategy.model.state_dict(keep_vars=True).items():
        name = flat_names.get(id(value))
        if name is not None:
            mapping.append([key, "param", name])
        else:
            mapping.append([key, "tensor", f"model.{key}"])
            tensors[f"model.{key}"] = value.detach()
    return mapping, tensors


class ShardWrite:
    """One rank's part of one save: the snapshot to write and, once written, its outcome."""

    def __init__(self, root: Path, step: int, topo: Topology, strategy: FlatStrategy, train_state: dict,
                 run_config: dict, copy: bool, after_written: Callable[[int], None] | None = None):
        self.root, self.step, self.topo, self.strategy = root, step, topo, strategy
        self.train_state, self.run_config, self.after_written = train_state, run_config, after_written
        self.final, self.tmp = root / step_dir_name(step), root / f".tmp-{step_dir_name(step)}"
        self.path = self.tmp / shard_file_name(topo.rank)
        # A background write needs a copy: training goes on changing the live buffers.
        self.state_dict_map, extras = model_entries(strategy)
        if topo.dp.rank != 0 or topo.tp.rank != 0:
            extras = {}  # replicated: the stage's first replica writes them
        shards = {k: v.detach().to("cpu", copy=copy).contiguous()
                  for k, v in {**strategy.state_shards(), **extras}.items()}
        self.shards = {**shards, **rng_state()}
        self.keys = list(self.shards)
        self.row: list[int] | None = None  # [bytes, sha256 as 4 int64 words] once written
        self.error: str | None = None

    def write(self) -> None:
        """Write, fsync, hash. Never raises: the outcome is exchanged at commit."""
        try:
            save_file(self.shards, str(self.path))
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

    @property
    def written(self) -> bool:
        return self.row is not None or self.error is not None


def begin(root: str | os.PathLike, step: int, topo: Topology) -> None:
    """Collective: rank 0 sweeps crashed saves' leftovers and makes this save's temporary directory."""
    root = Path(root)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if topo.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):  # left by saves that crashed: never checkpoints
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    topo.everyone.barrier()


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
    held = _gather_ragged(topo.everyone, [sum(b - a for a, b in ranges)] + [v for piece in pieces for v in piece])
    # The whole model's parameters and state_dict keys: each rank knows those of its own part.
    flat = job.strategy.flat
    described = _gather_json(topo.everyone, {
        "segments": [[s.name, s.logical, list(s.full_shape or s.shape)] for s in flat.segments],
        "state_dict": job.state_dict_map})
    failed = [rank for rank, r in enumerate(rows) if r[0]]
    if failed:
        where = f"step {job.step}: writing {job.path}"
        if job.error is not None:
            raise CheckpointError(f"{where} failed on rank {topo.rank}: {job.error}; `latest` still names the "
                                  "previous checkpoint")
        raise PeerSaveError(f"step {job.step}: checkpoint not saved: rank(s) {failed} could not write their shard")
    if topo.is_main:
        root, final, tmp = job.root, job.final, job.tmp
        manifest = _manifest(job.step, topo, job.strategy, job.train_state, job.run_config, job.keys,
                             [r[1:] for r in rows], held, described)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync_file(tmp / MANIFEST)
        _fsync_dir(tmp)
        old = _move_aside(root, final) if final.exists() else None
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_durably(root / LATEST, final.name + "\n")
        if old is not None:
            shutil.rmtree(old)
    topo.everyone.barrier()
    return job.final


def _gather_ragged(comm, values: list[int]) -> list[list[int]]:
    """Every rank's list of ints, of any length, on every rank (two fixed-size gathers)."""
    lengths = comm.gather_rows(torch.tensor([len(values)], dtype=torch.int64))[:, 0].tolist()
    padded = torch.zeros(max(lengths), dtype=torch.int64)
    padded[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return [row[:n] for row, n in zip(comm.gather_rows(padded).tolist(), lengths)]


def _gather_json(comm, obj) -> list:
    """Every rank's JSON-able `obj`, on every rank (as UTF-8 bytes: no pickles between ranks either)."""
    return [json.loads(bytes(row).decode()) for row in _gather_ragged(comm, list(json.dumps(obj).encode()))]


def save(root: str | os.PathLike, step: int, topo: Topology, strategy: FlatStrategy,
         train_state: dict, run_config: dict, after_written: Callable[[int], None] | None = None) -> Path:
    """Collective: every rank calls it. Returns the final step directory."""
    begin(root, step, topo)
    job = ShardWrite(Path(root), step, topo, strategy, train_state, run_config, copy=False,
                     after_written=after_written)
    job.write()
    return commit(job)


class AsyncSave:
    """A save whose file writes run in a background thread from a CPU snapshot of the shards.
    `begin` and the snapshot happen at construction (collective); `commit()` (collective) waits for
    the write, and only then is the checkpoint renamed into place and `latest` moved."""

    def __init__(self, root: str | os.PathLike, step: int, topo: Topology, strategy: FlatStrategy,
                 train_state: dict, run_config: dict, after_written: Callable[[int], None] | None = None):
        begin(root, step, topo)
        self.job = ShardWrite(Path(root), step, topo, strategy, train_state, run_config, copy=True,
                              after_written=after_written)
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


def _manifest(step, topo, strategy, train_state, run_config, keys, rows, held, described) -> dict:
    """rows: each rank's [file bytes, sha256 words]; held: each rank's [length of its stored vectors,
    then its pieces' at, lo, hi, ...] (empty pieces: it stores none); described: each rank's segments and
    state_dict map (model_entries)."""
    flat = strategy.flat
    # Parameters in their dtype, optimizer state in the master's (they differ in mixed precision).
    dtypes = {"params": flat.dtype, **{f"optim.{k}": t.dtype for k, t in strategy.optimizer.state_tensors().items()}}
    files, tensors = [], []
    for rank, (size, *digest_words) in enumerate(rows):
        name = shard_file_name(rank)
        digest = b"".join(w.to_bytes(8, "big", signed=True) for w in digest_words).hex()
        files.append({"name": name, "rank": rank, "bytes": size, "sha256": digest})
        local, *flat_pieces = held[rank]
        if flat_pieces:
            pieces = [flat_pieces[i:i + 3] for i in range(0, len(flat_pieces), 3)]
            for key in keys:
                if key.startswith(("params", "optim.")):
                    tensors.append({"key": key, "file": name, "dtype": str(dtypes[key]).removeprefix("torch."),
                                    "shape": [local], "pieces": pieces})
        tensors += [{"key": key, "file": name, "rank": rank} for key in keys if key.startswith("rng.")]
    segments, state_dict, stored = {}, {}, {}
    for rank, part in enumerate(described):
        for seg_name, offset, shape in part["segments"]:
            segments.setdefault(seg_name, {"name": seg_name, "offset": offset, "shape": shape})
        for key, kind, source in part["state_dict"]:
            state_dict.setdefault(key, {"key": key, kind: source})
            if kind == "tensor" and rank == _extras_writer(topo, rank):
                stored.setdefault(source, shard_file_name(rank))
    tensors += [{"key": key, "file": file} for key, file in stored.items()]
    return {
        "format": FORMAT,
        "step": step,
        "world_size": topo.world_size,
        "layout": {"dp": topo.dp.world_size, "tp": topo.tp.world_size, "pp": topo.pp.world_size},
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
    per_stage = topo.dp.world_size * topo.tp.world_size
    return rank // per_stage * per_stage


# --- find and verify ----------------------------------------------------------------------
def resolve(path: str | os.PathLike) -> Path:
    """A step directory from PATH: the directory itself if it has a manifest, else
    the one its `latest` pointer names (PATH may be a checkpoints/ or run directory)."""
    p = Path(path)
    for base in (p, p / "checkpoints"):
        if (base / MANIFEST).is_file():
            return base
        pointer = base / LATEST
        if pointer.is_file():
            name = pointer.read_text().strip()
            target = base / name
            if not name or "/" in name or not (target / MANIFEST).is_file():
                raise CheckpointError(f"{pointer} names '{name}', which is not a complete checkpoint directory")
            return target
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    raise CheckpointError(f"no checkpoint at {p}: expected a step directory with {MANIFEST}, "
                          f"or a directory with a '{LATEST}' pointer")


def complete_steps(root: Path) -> list[Path]:
    """Step directories under root that have a manifest, newest first (temporaries excluded)."""
    dirs = [d for d in root.glob("step-*") if (d / MANIFEST).is_file()]
    return sorted(dirs, key=lambda d: d.name, reverse=True)


def find_latest(out_dir: str | os.PathLike, warnings: list[str] | None = None) -> Path | None:
    """For --resume auto: the newest checkpoint under OUT/checkpoints that verifies (manifest and
    every sha256), or None if none was saved. A corrupt one is skipped, with a line naming the bad
    file appended to `warnings`, and the next older one is tried."""
    root = Path(out_dir) / "checkpoints"
    candidates = complete_steps(root) if root.is_dir() else []
    if (root / LATEST).exists():
        try:
            named = resolve(root)
            candidates = [named] + [d for d in candidates if d != named]
        except CheckpointError as e:
            if warnings is not None:
                warnings.append(f"{e}; looking for an older checkpoint")
    for step_dir in candidates:
        try:
            verify(step_dir)
            return step_dir
        except CheckpointError as e:
            if warnings is not None:
                warnings.append(f"skipping {step_dir.name}: {e}")
    if candidates:
        raise CheckpointError(f"no checkpoint under {root} verifies; see the warnings above")
    return None


def prune(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest keep_last complete checkpoints (never the one `latest` names)."""
    root = Path(root)
    keep = set(complete_steps(root)[:keep_last])
    if (root / LATEST).exists():
        keep.add(root / (root / LATEST).read_text().strip())
    doomed = [d for d in complete_steps(root) if d not in keep]
    for d in doomed:
        shutil.rmtree(d)
    return doomed


def read_manifest(step_dir: Path) -> dict:
    path = step_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete checkpoint") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} manifest")
    return manifest


def verify(path: str | os.PathLike) -> tuple[Path, dict]:
    """Resolve PATH, check every file's size and sha256; return (step dir, manifest)."""
    step_dir = resolve(path)
    manifest = read_manifest(step_dir)
    verify_files(step_dir, manifest, [entry["name"] for entry in manifest["files"]])
    return step_dir, manifest


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


def read_tensor(path: Path, key: str) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)
    except (SafetensorError, OSError, KeyError) as e:
        raise CheckpointError(f"cannot read '{key}' from {path}: {e}") from None


def verify_files(step_dir: Path, manifest: dict, names) -> None:
    """Check the named files' sizes and sha256 against the manifest, in the manifest's order."""
    entries = {e["name"]: e for e in manifest["files"]}
    for name in sorted(set(names), key=lambda n: list(entries).index(n) if n in entries else -1):
        entry = entries.get(name)
        f = step_dir / name
        if entry is None:
            raise CheckpointError(f"checkpoint {step_dir}: the manifest lists no file {name}")
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {f} has {size} bytes, manifest says {entry['bytes']}")
        digest = sha256_of(f)
        if digest != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupt: sha256 {digest[:16]}... "
                                  f"does not match the manifest's {entry['sha256'][:16]}...")


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


def read_local(step_dir: Path, manifest: dict, key: str, wanted: list[list[int]], length: int) -> torch.Tensor:
    """This rank's local vector of `key` (params, optim.*), read piece by piece from whichever files hold
    them: only the elements it holds are read. Padding stays zero; an uncovered element is an error."""
    entry = next(t for t in manifest["tensors"] if t["key"] == key)
    out = torch.zeros(length, dtype=getattr(torch, entry["dtype"]))
    covered = torch.zeros(length, dtype=torch.bool)
    for file, copies in plan_reads(manifest, key, wanted).items():
        try:
            with safe_open(str(step_dir / file), framework="pt") as f:
                stored = f.get_slice(key)
                size = stored.get_shape()[0]
                for at, local_at, n in copies:
                    if at + n > size:
                        raise CheckpointError(f"checkpoint {step_dir}: a piece of '{key}' lies outside {file}")
                    out[local_at:local_at + n] = stored[at:at + n]
                    covered[local_at:local_at + n] = True
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read '{key}' from {step_dir / file}: {e}") from None
    needed = sum(hi - lo for _, lo, hi in wanted)
    if int(covered.sum()) != needed:
        raise CheckpointError(f"checkpoint {step_dir} covers {int(covered.sum())} of the {needed} elements of "
                              f"'{key}' this rank holds")
    return out


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
    mine = {"params": flat.dtype, "optim.master": strategy.optimizer.master.dtype}
    stored = {m["key"]: m for m in manifest["state_dict"]}
    absent = [key for key in strategy.model.state_dict() if key not in stored]
    if absent:
        raise CheckpointError(f"checkpoint {step_dir} has no entry for {', '.join(absent[:5])}"
                              f"{' ...' if len(absent) > 5 else ''} of this model's state_dict")
    extras = {key: value for key, value in strategy.model.state_dict(keep_vars=True).items()
              if stored.get(key, {}).get("tensor")}
    files = {file for key in keys for file in plan_reads(manifest, key, wanted)}
    extra_files = {t["key"]: t["file"] for t in manifest["tensors"] if t["key"].startswith("model.")}
    files |= {extra_files[stored[key]["tensor"]] for key in extras if stored[key]["tensor"] in extra_files}
    same_world = manifest["world_size"] == topo.world_size
    if same_world:
        files.add(shard_file_name(topo.rank))
    verify_files(step_dir, manifest, files)
    for key, dtype in mine.items():
        theirs = next((t["dtype"] for t in manifest["tensors"] if t["key"] == key), None)
        if theirs != str(dtype).removeprefix("torch."):
            raise CheckpointError(f"checkpoint {step_dir} stores {key} in {theirs}, this run keeps them in "
                                  f"{str(dtype).removeprefix('torch.')} (resume with the dtype and precision it "
                                  "was saved with)")
    local = {key: read_local(step_dir, manifest, key, wanted, length) for key in keys}
    train_state = manifest["train_state"]
    strategy.load_local(local, train_state.get("optimizer_scalars") or {"steps_taken": train_state["optimizer_steps"]})
    with torch.no_grad():
        for key, value in extras.items():
            name = stored[key]["tensor"]
            if name not in extra_files:
                raise CheckpointError(f"checkpoint {step_dir} has no tensor for '{key}'")
            saved = read_tensor(step_dir / extra_files[name], name)
            if saved.shape != value.shape:
                raise CheckpointError(f"checkpoint {step_dir}: '{key}' has shape {list(saved.shape)}, the model's "
                                      f"is {list(value.shape)}")
            value.copy_(saved)  # in place: the tensor keeps its dtype and device
    if same_world:  # each rank continues its own random streams
        shard = step_dir / shard_file_name(topo.rank)
        set_rng_state({key: read_tensor(shard, key) for key in RNG_KEYS})
    return train_state
