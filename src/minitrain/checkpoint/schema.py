"""What a checkpoint must look like before any of it is used: the manifest's fields, the files it may
name, and each shard's safetensors header against the manifest.

Nothing in a checkpoint is trusted because it is there. The manifest is JSON that anyone (or a bad
disk) can change: it is checked field by field against MANIFEST_SCHEMA (jsonschema), then for what a
schema cannot say (the step matches the directory's name, the layout multiplies to the world size, one
file per rank named after its rank, every tensor in a listed file, pieces inside their tensors).
Files are plain names inside the step directory: no path, no `..`, no symlink. A shard's header (its
keys, dtypes and shapes, and the rank and step it says it was written by) must be what the manifest
says before a tensor is read, so a shard swapped, replaced or re-typed is refused even when its sha256
was updated to match. Every failure is a CheckpointError naming the file and the field, on one line.
"""
from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import torch
from safetensors import SafetensorError, safe_open

from .format import MANIFEST, WRITTEN_BY, CheckpointError, shard_file_name, written_by

SHARD_NAME = r"^rank-[0-9]{5}\.safetensors$"
STEP_DIR = re.compile(r"^(?:\.old-)?step-([0-9]+)$")  # a step directory, or one moved aside during a re-save
# torch dtype names (as the manifest writes them) -> safetensors' header codes.
DTYPES = {"float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
# The random-number states every shard holds (files.rng_state): dtype and the lengths it may have.
RNG_DTYPES = {"rng.torch": "U8", "rng.python": "I64", "rng.python_gauss": "F64", "rng.numpy": "I64",
              "rng.numpy_gauss": "F64", "rng.cuda": "U8"}
RNG_LENGTHS = {"rng.torch": {torch.get_rng_state().numel()},  # the CPU generator's state
               "rng.python": {625},  # Mersenne Twister: 624 words and a position
               "rng.python_gauss": {0, 1},  # a cached Gaussian, or none
               "rng.numpy": {626},  # 624 words, a position, whether a Gaussian is cached
               "rng.numpy_gauss": {1}}

_count = {"type": "integer", "minimum": 0}
_name = {"type": "string", "minLength": 1, "maxLength": 4096}
_shape = {"type": "array", "items": _count, "maxItems": 16}
MANIFEST_SCHEMA = {
    "type": "object",
    "required": ["format", "step", "world_size", "layout", "strategy", "zero", "model", "flat", "state_dict",
                 "files", "tensors", "train_state", "config"],
    "properties": {
        "format": {"type": "string"},
        "step": _count,
        "world_size": {"type": "integer", "minimum": 1},
        "layout": {"type": "object", "required": ["dp", "tp", "pp"],
                   "properties": {k: {"type": "integer", "minimum": 1} for k in ("dp", "tp", "pp", "ep", "cp")}},
        "strategy": _name,
        "zero": {"type": "integer", "minimum": 0, "maximum": 3},
        "model": {"type": ["object", "null"]},
        "flat": {"type": "object", "required": ["numel", "padded_numel", "segments", "units"],
                 "properties": {
                     "numel": _count, "padded_numel": _count, "padding": _count,
                     "segments": {"type": "array", "items": {
                         "type": "object", "required": ["name", "offset", "shape"],
                         "properties": {"name": _name, "offset": _count, "shape": _shape}}},
                     "units": {"type": "array", "items": {
                         "type": "object", "required": ["name", "padded_numel"],
                         "properties": {"name": _name, "padded_numel": _count}}}}},
        "state_dict": {"type": "array", "items": {
            "type": "object", "required": ["key", "shape", "dtype"],
            "properties": {"key": _name, "param": _name, "tensor": _name, "shape": _shape,
                           "dtype": {"type": "string", "pattern": "^[a-z0-9_]{1,32}$"}},
            "oneOf": [{"required": ["param"]}, {"required": ["tensor"]}]}},
        "files": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "rank", "bytes", "sha256"],
            "properties": {"name": {"type": "string", "pattern": SHARD_NAME}, "rank": _count, "bytes": _count,
                           "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}}},
        "tensors": {"type": "array", "items": {
            "type": "object", "required": ["key", "file"],
            "properties": {"key": _name, "file": {"type": "string", "pattern": SHARD_NAME},
                           "dtype": {"enum": list(DTYPES)}, "shape": _shape, "rank": _count,
                           "pieces": {"type": "array", "items": {"type": "array", "items": _count,
                                                                 "minItems": 3, "maxItems": 3}}},
            "dependentRequired": {"pieces": ["dtype", "shape"]}}},
        "train_state": {"type": "object", "required": ["step", "optimizer_steps", "optimizer_scalars"],
                        "properties": {
                            "step": _count, "optimizer_steps": _count, "optimizer_scalars": {"type": "object", "properties": {
                                "steps_taken": _count,
                                # a torch optimizer's scalar states (minitrain.prepare): the dtype of each, or
                                # null for a plain number
                                "scalars": {"type": "object", "additionalProperties": {"enum": [None, *DTYPES]}}}},
                            # the user's optimizer's class and its param groups' options (minitrain.save_checkpoint)
                            "optimizer": {"type": "string", "maxLength": 512},
                            "param_groups": {"type": "array", "items": {"type": "object"}},
                            "tokens_seen": _count,
                            "corpus_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                            # the position of the run's loader: over one array of tokens (data.ShardedLoader),
                            # or over sharded corpora (corpus/token_shards.py: each corpus's epoch and position)
                            "loader": {"type": "object",
                                       "required": ["seed", "global_batch", "num_examples"],
                                       "properties": {"seed": {"type": "integer"},
                                                      "global_batch": {"type": "integer", "minimum": 1},
                                                      "num_examples": _count},
                                       "anyOf": [
                                           {"required": ["epoch", "cursor"],
                                            "properties": {"epoch": _count, "cursor": _count}},
                                           {"required": ["format", "batch", "positions", "fingerprint"],
                                            "properties": {"format": {"const": "token-shards/1"}, "batch": _count,
                                                           "positions": {"type": "array", "items": {
                                                               "type": "array", "items": _count,
                                                               "minItems": 2, "maxItems": 2}},
                                                           "fingerprint": {"type": "string",
                                                                           "pattern": "^[0-9a-f]{64}$"}}}]},
                            "recent_losses": {"type": ["array", "null"], "items": {"type": "number"}},
                            "loss_scaler": {"type": ["object", "null"], "required": ["scale", "clean_steps"],
                                            "properties": {"scale": {"type": "number", "exclusiveMinimum": 0},
                                                           "clean_steps": _count}}}},
        "config": {"type": "object"},
    },
    # `minitrain train` saves its whole run config and the state its loop resumes from; a checkpoint of
    # minitrain.save_checkpoint records the prepare() settings and the user's optimizer's own scalars.
    "if": {"properties": {"config": {"required": ["train"]}}},
    "then": {"properties": {"train_state": {
        "required": ["tokens_seen", "corpus_sha256", "loader", "recent_losses", "loss_scaler"],
        "properties": {"optimizer_scalars": {"required": ["steps_taken"]}}}}},
}
# JSON Schema counts 3.0 as an integer; an offset or a count used to index must be a Python int.
_STRICT_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
_VALIDATOR = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_STRICT_TYPES)(MANIFEST_SCHEMA)


def _field(path) -> str:
    """A JSON path as the reader would write it: files[1].sha256."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".") or "(the whole manifest)"


def check_manifest(step_dir: Path, manifest: dict) -> None:
    """Refuse a manifest that is malformed or does not describe its own directory (CheckpointError, one line)."""
    where = step_dir / MANIFEST
    error = jsonschema.exceptions.best_match(_VALIDATOR.iter_errors(manifest))
    if error is not None:
        message = error.message if len(error.message) <= 120 else error.message[:117] + "..."
        raise CheckpointError(f"{where}: field {_field(error.absolute_path)} is invalid: {message}")

    def bad(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: field {field} {why}")

    named = STEP_DIR.match(step_dir.name)
    if named is None or int(named.group(1)) != manifest["step"]:
        raise bad("step", f"is {manifest['step']}, but the directory is {step_dir.name}")
    if manifest["train_state"]["step"] != manifest["step"]:
        raise bad("train_state.step", f"is {manifest['train_state']['step']}, the manifest's step {manifest['step']}")
    layout = manifest["layout"]
    if layout["dp"] * layout["tp"] * layout["pp"] * layout.get("ep", 1) * layout.get("cp", 1) != manifest["world_size"]:
        raise bad("layout", f"{layout} does not multiply to world_size {manifest['world_size']}")
    files = manifest["files"]
    for i, entry in enumerate(files):
        if entry["rank"] != i or entry["name"] != shard_file_name(i):
            raise bad(f"files[{i}]", f"is {entry['name']} of rank {entry['rank']}; expected {shard_file_name(i)} "
                                     f"of rank {i}")
    if len(files) != manifest["world_size"]:
        raise bad("files", f"lists {len(files)} files for world_size {manifest['world_size']}")
    flat, seen, names = manifest["flat"], set(), {f["name"] for f in files}
    for i, t in enumerate(manifest["tensors"]):
        if t["file"] not in names:
            raise bad(f"tensors[{i}].file", f"{t['file']} is not one of the manifest's files")
        if (t["file"], t["key"]) in seen:
            raise bad(f"tensors[{i}]", f"repeats '{t['key']}' in {t['file']}")
        seen.add((t["file"], t["key"]))
        if "pieces" in t:
            if len(t["shape"]) != 1:
                raise bad(f"tensors[{i}].shape", f"is {t['shape']}; flat vectors are 1-D")
            for at, lo, hi in t["pieces"]:
                if not (lo < hi <= flat["numel"] and at + hi - lo <= t["shape"][0]):
                    raise bad(f"tensors[{i}].pieces", f"has {[at, lo, hi]}, outside the tensor or the parameters")
    at = 0  # the parameters lie end to end, in order, and fill the logical vector exactly
    for i, seg in enumerate(flat["segments"]):
        numel = 1
        for d in seg["shape"]:
            numel *= d
        if seg["offset"] + numel > flat["numel"]:
            raise bad(f"flat.segments[{i}]", f"{seg['name']} ends past the {flat['numel']} parameters")
        if seg["offset"] != at:
            raise bad(f"flat.segments[{i}].offset", f"is {seg['offset']}; {seg['name']} should start at {at}")
        at += numel
    if at != flat["numel"]:
        raise bad("flat.numel", f"is {flat['numel']}, the segments hold {at}")


def check_shard_header(step_dir: Path, manifest: dict, name: str) -> None:
    """The shard's keys, dtypes and shapes, and the rank and step it was written for, are the manifest's."""
    path = step_dir / name
    expected = {t["key"]: t for t in manifest["tensors"] if t["file"] == name}
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata, keys = f.metadata() or {}, set(f.keys())
            header = {key: (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()) for key in keys}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    rank = int(name[len("rank-"):-len(".safetensors")])
    said = metadata.get(WRITTEN_BY, "nobody it names")
    if said != written_by(rank, manifest["step"]):
        raise CheckpointError(f"{path}: written by {said}, the manifest lists it as {written_by(rank, manifest['step'])}")
    if keys != set(expected):
        odd = min(keys ^ set(expected))
        raise CheckpointError(f"{path}: tensor '{odd}' is {'not in the manifest' if odd in keys else 'missing'}")
    for key, (dtype, shape) in header.items():
        t = expected[key]
        want_dtype = DTYPES.get(t["dtype"]) if "dtype" in t else RNG_DTYPES.get(key)
        if want_dtype is not None and dtype != want_dtype:
            raise CheckpointError(f"{path}: tensor '{key}' is {dtype}, the manifest says {want_dtype}")
        if t.get("rank", rank) != rank:
            raise CheckpointError(f"{path}: the manifest gives tensor '{key}' to rank {t['rank']}, the file is rank {rank}'s")
        if "shape" in t and list(shape) != t["shape"]:
            raise CheckpointError(f"{path}: tensor '{key}' has shape {list(shape)}, the manifest says {t['shape']}")
        if key in RNG_LENGTHS and (len(shape) != 1 or shape[0] not in RNG_LENGTHS[key]):
            raise CheckpointError(f"{path}: tensor '{key}' has shape {list(shape)}; a random state of this kind has "
                                  f"{' or '.join(map(str, sorted(RNG_LENGTHS[key])))} elements")
        if key == "rng.cuda" and (len(shape) != 2 or shape[0] < 1):
            raise CheckpointError(f"{path}: tensor '{key}' has shape {list(shape)}; the CUDA generators' states are "
                                  "(devices, state bytes)")
