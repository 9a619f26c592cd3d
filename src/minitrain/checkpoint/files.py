"""The checkpoint format's files: names, the manifest, durable writes, sha256 checks, random-number states,
and finding the newest complete checkpoint. (What the format holds: checkpoint/__init__.py.)"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ..utils.progress import byte_bar

from .format import FORMAT, LATEST, MANIFEST, MANIFEST_SHA, CheckpointError, step_of
from .schema import check_manifest, check_shard_header


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()  # a bar on a terminal for a large file: hashing it takes a while
    with open(path, "rb") as f, byte_bar(os.fstat(f.fileno()).st_size, f"sha256 {path.name}") as bar:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            bar.update(len(chunk))
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
    """Write text to path via a temporary file, fsync and rename: all or nothing (CheckpointError, and no
    temporary left, if the disk refuses)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"writing {path} failed: {e.strerror or e}; it still says what it said before") from None


# --- random number generators ----------------------------------------------------------------
RNG_KEYS = ("rng.torch", "rng.python", "rng.python_gauss", "rng.numpy", "rng.numpy_gauss")
CUDA_RNG = "rng.cuda"  # a process with CUDA also saves every device's generator: (devices, state bytes)


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch (CPU, and every CUDA device's), python and numpy generator states as tensors
    (safetensors holds nothing else). Mersenne Twister words fit int64; a cached Gaussian, if any, is a float64."""
    _, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"rng.torch": torch.get_rng_state(),
             "rng.python": torch.tensor(words, dtype=torch.int64),
             "rng.python_gauss": torch.tensor([] if gauss is None else [gauss], dtype=torch.float64),
             "rng.numpy": torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64),
             "rng.numpy_gauss": torch.tensor([cached], dtype=torch.float64)}
    if torch.cuda.is_available():  # dropout on a GPU draws from these, not from the CPU generator
        state[CUDA_RNG] = torch.stack([s.cpu() for s in torch.cuda.get_rng_state_all()])
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what rng_state() gave. CUDA generators are restored where both the save and this process have
    CUDA, device by device (as many as both have)."""
    if CUDA_RNG in state and torch.cuda.is_available():
        devices = min(len(state[CUDA_RNG]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(list(state[CUDA_RNG][:devices]))
    torch.set_rng_state(state["rng.torch"])
    gauss = state["rng.python_gauss"].tolist()
    random.setstate((3, tuple(state["rng.python"].tolist()), gauss[0] if gauss else None))
    *keys, pos, has_gauss = state["rng.numpy"].tolist()
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss,
                         float(state["rng.numpy_gauss"][0])))


# --- find and verify ----------------------------------------------------------------------
def resolve(path: str | os.PathLike) -> Path:
    """A step directory from PATH: the directory itself if it has a manifest, else
    the one its `latest` pointer names (PATH may be a checkpoints/ or run directory)."""
    p = Path(path)
    for base in (p, p / "checkpoints"):
        if (base / MANIFEST).is_file():
            return base
        pointer = base / LATEST
        if pointer.is_symlink():  # written by rename, never a link: and a link's target is nobody's business here
            raise CheckpointError(f"{pointer} is a symlink; `latest` is a file naming a step directory")
        if pointer.is_file():
            name = pointer.read_text(errors="replace").strip()
            target = base / name
            if not name or "/" in name or not (target / MANIFEST).is_file():
                shown = name if len(name) <= 40 and name.isprintable() else repr(name[:40]) + "..."
                raise CheckpointError(f"{pointer} names '{shown}', which is not a complete checkpoint directory")
            return target
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    raise CheckpointError(f"no checkpoint at {p}: expected a step directory with {MANIFEST}, "
                          f"or a directory with a '{LATEST}' pointer")


def complete_steps(root: Path) -> list[Path]:
    """Step directories under root that have a manifest, newest (highest step) first; temporaries excluded."""
    dirs = [d for d in root.glob("step-*") if re.fullmatch(r"step-[0-9]+", d.name) and (d / MANIFEST).is_file()]
    return sorted(dirs, key=step_of, reverse=True)


def find_latest(out_dir: str | os.PathLike, warnings: list[str] | None = None) -> Path | None:
    """For --resume auto: the newest checkpoint under OUT/checkpoints that verifies (manifest and
    every sha256), or None if none was saved. A corrupt one is skipped, with a line naming the bad
    file appended to `warnings`, and the next older one is tried."""
    root = Path(out_dir) / "checkpoints"
    candidates = complete_steps(root) if root.is_dir() else []
    pointer = os.path.lexists(root / LATEST)  # even a dangling symlink: something was saved here
    if pointer:
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
    if candidates or pointer:  # a run was saved here: starting over would overwrite it
        raise CheckpointError(f"no checkpoint under {root} verifies; see the warnings above (to start over, "
                              f"move {Path(out_dir)} aside)")
    return None


def set_aside_corrupt(root: str | os.PathLike, after_step: int) -> list[Path]:
    """After a resume from `after_step`: rename every complete checkpoint of a later step that does not verify (the
    resume went back past it) to corrupt-step-NNNNNN beside it, so that no listing takes it for a checkpoint again
    and its files stay for a look. Returns the new paths (one renamed meanwhile by another process is passed over)."""
    moved = []
    for step_dir in complete_steps(Path(root)):
        if step_of(step_dir) <= after_step:
            continue
        try:
            verify(step_dir)
            continue  # a later line's, whole: prune's business
        except CheckpointError:
            pass
        target = step_dir.with_name(f"corrupt-{step_dir.name}")
        if target.exists():  # set aside once before: keep both
            target = step_dir.with_name(f"corrupt-{step_dir.name}-{os.getpid()}")
        try:
            os.rename(step_dir, target)
        except FileNotFoundError:
            continue
        moved.append(target)
    return moved


def prune(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest keep_last complete checkpoints of the run's current line, never the one
    `latest` names. Checkpoints of steps after `latest`'s belong to a line abandoned by resuming from an
    older step: they are deleted too (else they would be "the newest" and push this line's out)."""
    root = Path(root)
    steps = complete_steps(root)
    current = resolve(root) if (root / LATEST).is_file() else None
    line = [d for d in steps if current is None or step_of(d) <= step_of(current)]
    keep = set(line[:keep_last]) | ({current} if current is not None else set())
    doomed = [d for d in steps if d not in keep]
    for d in doomed:
        shutil.rmtree(d)
    return doomed


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def read_manifest(step_dir: Path) -> dict:
    """The step directory's manifest, once its own sha256 (manifest.sha256) matches and every field checks
    out (schema.check_manifest); CheckpointError otherwise."""
    path = step_dir / MANIFEST
    for link in (step_dir, path, step_dir / MANIFEST_SHA):
        if link.is_symlink():
            raise CheckpointError(f"{link} is a symlink; a checkpoint's files live in its own directory")
    try:
        raw = path.read_bytes()
        recorded = (step_dir / MANIFEST_SHA).read_text().strip()
    except FileNotFoundError as e:
        raise CheckpointError(f"{e.filename} is missing: not a complete checkpoint") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it ({e})") from None
    if hashlib.sha256(raw).hexdigest() != recorded:
        raise CheckpointError(f"{path} does not match {MANIFEST_SHA}: the manifest was changed after the save")
    try:  # strict JSON: no NaN or Infinity (nothing minitrain writes holds one), nothing absurdly deep or long
        manifest = json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        older = isinstance(found, str) and found.startswith("minitrain-checkpoint/")
        raise CheckpointError(f"{path} is not a {FORMAT} manifest" + (
            f" ({found}: written by an older minitrain, which can still read it)" if older else ""))
    check_manifest(step_dir, manifest)
    return manifest


def verify(path: str | os.PathLike) -> tuple[Path, dict]:
    """Resolve PATH, check every file's size and sha256; return (step dir, manifest)."""
    step_dir = resolve(path)
    manifest = read_manifest(step_dir)
    verify_files(step_dir, manifest, [entry["name"] for entry in manifest["files"]])
    return step_dir, manifest


def read_tensor(path: Path, key: str) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)
    except (SafetensorError, OSError, KeyError) as e:
        raise CheckpointError(f"cannot read '{key}' from {path}: {e}") from None


def verify_files(step_dir: Path, manifest: dict, names) -> None:
    """Check the named files' sizes, sha256 and safetensors headers against the manifest, in its order."""
    names = set(names)
    unknown = names - {e["name"] for e in manifest["files"]}
    if unknown:
        raise CheckpointError(f"checkpoint {step_dir}: the manifest lists no file {min(unknown)}")
    for entry in manifest["files"]:
        if entry["name"] not in names:
            continue
        f = step_dir / entry["name"]
        if f.is_symlink():
            raise CheckpointError(f"checkpoint file {f} is a symlink; a checkpoint's files live in its own directory")
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {f} has {size} bytes, manifest says {entry['bytes']}")
        digest = sha256_of(f)
        if digest != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupt: sha256 {digest[:16]}... "
                                  f"does not match the manifest's {entry['sha256'][:16]}...")
        check_shard_header(step_dir, manifest, entry["name"])
