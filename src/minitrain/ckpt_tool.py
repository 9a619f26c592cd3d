"""`minitrain ckpt inspect | verify | consolidate`: look into a sharded checkpoint without training.

- inspect PATH: step, topology, strategy, model, files, and every stored tensor
  with the logical range it covers.
- verify PATH: every file's size and sha256 against the manifest; exit 0, or 1
  with the bad file named.
- consolidate PATH OUT.safetensors: the parameters as one plain state dict
  (MiniGPT.load_state_dict accepts it; tied weights appear under both names),
  from whatever world size and ZeRO stage wrote the checkpoint.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import checkpoint
from .config import ConfigError, ModelConfig
from .metrics import format_table, human_bytes
from .model import MiniGPT


def inspect(path: str) -> str:
    step_dir, manifest = checkpoint.verify(path)
    layout, flat = manifest["layout"], manifest["flat"]
    model = ", ".join(f"{k} {v}" for k, v in manifest["model"].items() if k != "preset")
    lines = [f"checkpoint {step_dir} ({manifest['format']}, verified)",
             f"step {manifest['step']}; world size {manifest['world_size']} (dp {layout['dp']}, tp {layout['tp']}, "
             f"pp {layout['pp']}); strategy {manifest['strategy']} (ZeRO-{manifest['zero']})",
             f"model: {model}",
             f"parameters: {flat['numel']:,} in {len(flat['segments'])} tensors; "
             + ("" if layout["pp"] == 1 else "pipeline stage 0's ")
             + f"{len(flat['units'])} units, padded to {flat['padded_numel']:,}",
             f"training state: optimizer steps {manifest['train_state']['optimizer_steps']}, "
             f"tokens seen {manifest['train_state']['tokens_seen']:,}, "
             f"loader epoch {manifest['train_state']['loader']['epoch']} cursor "
             f"{manifest['train_state']['loader']['cursor']}",
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


def consolidated_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters as MiniGPT's state dict (each tensor its own copy)."""
    step_dir, manifest = checkpoint.verify(path)
    params = checkpoint.assemble_flat(step_dir, manifest)["params"]
    fields = {k: v for k, v in manifest["model"].items() if k in ModelConfig.__dataclass_fields__}
    with torch.device("meta"):  # names and shapes only; no memory for the weights
        model = MiniGPT(ModelConfig(**fields))
    by_param = {}
    for seg in manifest["flat"]["segments"]:
        n = 1
        for d in seg["shape"]:
            n *= d
        by_param[seg["name"]] = params[seg["offset"]:seg["offset"] + n].view(seg["shape"])
    canonical = {id(p): name for name, p in model.named_parameters()}
    state = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = canonical.get(id(value))
        if name is None or name not in by_param:
            raise checkpoint.CheckpointError(f"checkpoint {step_dir} has no tensor for '{key}'")
        state[key] = by_param[name].clone()  # tied weights: two keys, two copies (safetensors stores no aliases)
    return state


def consolidate(path: str, out: str) -> str:
    target = Path(out)
    if target.suffix != ".safetensors":
        raise ConfigError(f"output {target} should end in .safetensors")
    if not target.parent.is_dir():
        raise ConfigError(f"output directory {target.parent} does not exist")
    state = consolidated_state_dict(path)
    tmp = target.with_name(target.name + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, target)  # never a half-written OUT
    numel = sum(t.numel() for t in state.values())
    return f"wrote {target}: {len(state)} tensors, {numel:,} values ({human_bytes(target.stat().st_size)})"
