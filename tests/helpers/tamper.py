"""Editing a checkpoint as an attacker (or a careless script) who knows the format would."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors.torch import save_file

from minitrain import checkpoint


def read_manifest_json(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())


def resign(step_dir: Path, manifest: dict) -> None:
    """Write `manifest`, with its sha256 record (manifest.sha256) updated to match."""
    resign_text(step_dir, json.dumps(manifest))


def resign_text(step_dir: Path, text: str) -> None:
    """Write `text` as the manifest, whatever it holds, with its sha256 record updated to match."""
    (step_dir / "manifest.json").write_text(text)
    (step_dir / "manifest.sha256").write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


def resign_file(step_dir: Path, name: str) -> dict:
    """The manifest's bytes and sha256 of file `name` updated to what is on disk now; returns the manifest."""
    manifest = read_manifest_json(step_dir)
    path = step_dir / name
    next(f for f in manifest["files"] if f["name"] == name).update(bytes=path.stat().st_size,
                                                                  sha256=checkpoint.sha256_of(path))
    resign(step_dir, manifest)
    return manifest


def replace_shard(step_dir: Path, name: str, tensors: dict, metadata: dict | None = None) -> dict:
    """Replace a shard file, re-signed in the manifest."""
    save_file(tensors, str(step_dir / name), metadata=metadata)
    return resign_file(step_dir, name)
