"""`minitrain ckpt inspect | verify | consolidate`: look into a sharded checkpoint without training.

- inspect PATH: step, topology, strategy, model, files, and every stored tensor
  with the logical range it covers.
- verify PATH: every file's size and sha256 against the manifest; exit 0, or 1
  with the bad file named.
- consolidate PATH OUT.safetensors: the model's own state_dict as one file:
  exactly its keys (trainable and frozen parameters, persistent buffers; tied
  weights under both names; no wrapper prefixes), so its load_state_dict(strict)
  and Hugging Face's from_pretrained accept it, from whatever world size, ZeRO
  stage or layout wrote the checkpoint.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import checkpoint
from ..config import ConfigError
from ..train.metrics import format_table, human_bytes
from ..parallel.placement import check_state


def inspect(path: str) -> str:
    step_dir, manifest = checkpoint.verify(path)
    layout, flat = manifest["layout"], manifest["flat"]
    model = ", ".join(f"{k} {v}" for k, v in (manifest["model"] or {}).items() if k != "preset") or "(not a MiniGPT)"
    lines = [f"checkpoint {step_dir} ({manifest['format']}, verified)",
             f"step {manifest['step']}; world size {manifest['world_size']} (dp {layout['dp']}, tp {layout['tp']}, "
             f"pp {layout['pp']}); strategy {manifest['strategy']} (ZeRO-{manifest['zero']})",
             f"model: {model}",
             f"parameters: {flat['numel']:,} in {len(flat['segments'])} tensors; "
             + ("" if layout["pp"] == 1 else "pipeline stage 0's ")
             + f"{len(flat['units'])} units, padded to {flat['padded_numel']:,}",
             _training_state(manifest["train_state"]),
             "",
             format_table(["file", "rank", "bytes", "sha256"],
                          [[f["name"], f["rank"], human_bytes(f["bytes"]), f["sha256"][:16] + "..."]
                           for f in manifest["files"]], "<>><"),
             ""]
    rows = []
    for t in manifest["tensors"]:
        pieces = t.get("pieces", [])
        span = f"{min(p[1] for p in pieces)}..{max(p[2] for p in pieces)}" if pieces else "(per-rank state)"
        rows.append([t["key"], t["file"], t.get("dtype", "-"), "x".join(map(str, t.get("shape", []))) or "-",
                     len(pieces), span])
    lines.append(format_table(["tensor", "file", "dtype", "shape", "pieces", "logical range"], rows, "<<<><<"))
    return "\n".join(lines)


def verify(path: str) -> str:
    step_dir, manifest = checkpoint.verify(path)
    total = sum(f["bytes"] for f in manifest["files"])
    return f"OK: {step_dir}: {len(manifest['files'])} files, {human_bytes(total)}, every sha256 matches the manifest"


def _training_state(state: dict) -> str:
    line = f"training state: optimizer steps {state['optimizer_steps']}"
    if "loader" in state:  # a CLI run's
        line += (f", tokens seen {state['tokens_seen']:,}, loader epoch {state['loader']['epoch']} cursor "
                 f"{state['loader']['cursor']}")
    return line


def consolidated_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's model as its own state_dict (each tensor its own copy), keys in the model's order."""
    step_dir, manifest = checkpoint.verify(path)
    params = checkpoint.assemble_flat(step_dir, manifest)["params"]
    by_param = {}
    for seg in manifest["flat"]["segments"]:
        n = 1
        for d in seg["shape"]:
            n *= d
        by_param[seg["name"]] = params[seg["offset"]:seg["offset"] + n].view(seg["shape"])
    stored = {t["key"]: t["file"] for t in manifest["tensors"] if t["key"].startswith("model.")}
    state = {}
    for entry in manifest["state_dict"]:
        key = entry["key"]
        if "param" in entry and entry["param"] in by_param:
            state[key] = by_param[entry["param"]].clone()  # tied weights: two keys, two copies (no aliases in files)
        elif entry.get("tensor") in stored:
            state[key] = checkpoint.read_tensor(step_dir / stored[entry["tensor"]], entry["tensor"])
        else:
            raise checkpoint.CheckpointError(f"checkpoint {step_dir} has no tensor for '{key}'")
    # The result is checked against the model's own state_dict as the save recorded it (names, whole shapes,
    # dtypes): a slice or a stray tensor is an error naming its key, never a file.
    check_state(state, {e["key"]: (e["shape"], e["dtype"]) for e in manifest["state_dict"]},
                f"checkpoint {step_dir} consolidated", checkpoint.CheckpointError)
    return state


def consolidate(path: str, out: str) -> str:
    target = Path(out)
    if target.suffix != ".safetensors":
        raise ConfigError(f"output {target} should end in .safetensors")
    if not target.parent.is_dir():
        raise ConfigError(f"output directory {target.parent} does not exist")
    step_dir = checkpoint.resolve(path)
    if target.resolve().parent == step_dir.resolve():
        raise ConfigError(f"output {target} is inside the checkpoint {step_dir}; write it elsewhere")
    state = consolidated_state_dict(str(step_dir))  # the directory checked above, not `latest` read again
    tmp = target.with_name(target.name + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})  # the metadata Hugging Face's loader expects
    os.replace(tmp, target)  # never a half-written OUT
    numel = sum(t.numel() for t in state.values())
    return f"wrote {target}: {len(state)} tensors, {numel:,} values ({human_bytes(target.stat().st_size)})"
