"""`minitrain ckpt list | inspect | verify | consolidate`: look into a sharded checkpoint without training.

PATH is a local checkpoint (a step, checkpoints/ or run directory) or a URL of object storage that a run's
--ckpt.dir names (its newest committed checkpoint, or URL/step-NNNNNN), fetched and verified into a temporary
directory first.

- list PATH: the complete checkpoints there, newest first.
- inspect PATH: step, topology, strategy, model, files, and every stored tensor
  with the logical range it covers.
- verify PATH: every file's size and sha256 against the manifest.

Exit codes, for every action: 0 the checkpoint is valid (and the action done), 1 it is not (one line
naming the bad file or field), 2 a usage error (no such PATH, a bad argument, an unusable OUT).
- consolidate PATH OUT.safetensors: the model's own state_dict as one file:
  exactly its keys (trainable and frozen parameters, persistent buffers; tied
  weights under both names; no wrapper prefixes), so its load_state_dict(strict)
  and Hugging Face's from_pretrained accept it, from whatever world size, ZeRO
  stage or layout wrote the checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

from .. import checkpoint
from ..checkpoint import remote
from ..config import ConfigError
from ..train.metrics import format_table, human_bytes


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
        loader = state["loader"]
        where = (f"epoch {loader['epoch']} cursor {loader['cursor']}" if "cursor" in loader else
                 f"global batch {loader['batch']}, (epoch, position) of each corpus {loader['positions']}")
        line += f", tokens seen {state['tokens_seen']:,}, loader {where}"
    return line


def consolidate(path: str, out: str) -> str:
    target = Path(out)
    if target.suffix != ".safetensors":
        raise ConfigError(f"output {target} should end in .safetensors")
    if not target.parent.is_dir():
        raise ConfigError(f"output directory {target.parent} does not exist")
    step_dir = checkpoint.resolve(path)
    if target.resolve().parent == step_dir.resolve():
        raise ConfigError(f"output {target} is inside the checkpoint {step_dir}; write it elsewhere")
    state = checkpoint.consolidated_state_dict(str(step_dir))  # the directory checked above, not `latest` read again
    tmp = target.with_name(target.name + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})  # the metadata Hugging Face's loader expects
    os.replace(tmp, target)  # never a half-written OUT
    numel = sum(t.numel() for t in state.values())
    return f"wrote {target}: {len(state)} tensors, {numel:,} values ({human_bytes(target.stat().st_size)})"


def add_parser(sub) -> argparse.ArgumentParser:
    ckpt = sub.add_parser("ckpt", help="list, inspect, verify or consolidate checkpoints",
                          description="Look into a sharded checkpoint. PATH is a step directory, a checkpoints/ "
                          "directory or a run directory (its `latest` is used), or a --ckpt.dir URL (s3://bucket/"
                          "prefix: its newest committed checkpoint; .../step-NNNNNN: that one). Exit 0 valid, 1 "
                          "invalid (what is wrong named), 2 a usage error (no such PATH, a bad argument).")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt", required=True, parser_class=type(ckpt), metavar="ACTION")
    for action, text in (("list", "the complete checkpoints, newest first"),
                         ("inspect", "step, topology, files and tensors"),
                         ("verify", "every file's size and sha256 against the manifest")):
        ckpt_sub.add_parser(action, help=text, description=text).add_argument("path", metavar="PATH")
    merge = ckpt_sub.add_parser("consolidate", help="one plain state dict that MiniGPT.load_state_dict accepts",
                                description="Write the parameters as one safetensors state dict, whatever world "
                                "size and ZeRO stage saved them.")
    merge.add_argument("path", metavar="PATH")
    merge.add_argument("out", metavar="OUT.safetensors")

    return ckpt


def listing(location: str) -> str:
    """The complete checkpoints of a run directory, a checkpoints/ directory or a store's URL, newest first."""
    if remote.is_url(location):
        rows = remote.listing(location)
        where = location
    else:
        root = Path(location)
        root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
        rows = [{"step": checkpoint.step_of(d), "bytes": sum(f.stat().st_size for f in d.iterdir()),
                 "prefix": d.name} for d in checkpoint.complete_steps(root)]
        where = str(root)
    if not rows:
        return f"{where}: no complete checkpoint"
    return f"{where}: {len(rows)} complete checkpoint(s), newest first\n" + format_table(
        ["step", "bytes", "where"], [[r["step"], human_bytes(r["bytes"]), r["prefix"]] for r in rows], "><<")


def run(args) -> int:
    if not remote.is_url(args.path) and not os.path.lexists(args.path):  # a mistyped path is the caller's error
        raise ConfigError(f"no such file or directory: {args.path}")
    try:
        if args.ckpt == "list":
            print(listing(args.path))
            return 0
        with remote.local_copy(args.path) as path:  # a URL's checkpoint, fetched and verified
            if args.ckpt == "inspect":
                print(inspect(path))
            elif args.ckpt == "verify":
                print(verify(path))
            else:
                print(consolidate(path, args.out))
    except checkpoint.CheckpointError as e:  # a failed check, not a usage error
        print(f"minitrain ckpt {args.ckpt}: FAILED: {e}", file=sys.stderr)
        return 1
    return 0
