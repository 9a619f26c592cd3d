"""`minitrain export RUN_OR_CKPT OUT`: a trained run as a directory a person uses.

OUT holds what `minitrain sample` (or any loader of MiniGPT) needs, and nothing else:
- model.safetensors: the consolidated parameters under MiniGPT's own state_dict keys, whatever
  world size, ZeRO stage or dp x tp x pp layout saved them (checkpoint/consolidate.py);
- config.json: the model's settings (MiniGPT(ModelConfig(**config["model"])) rebuilds it), the
  step, the checkpoint it came from and the tokenizer file's name;
- tokenizer.json: the corpus's tokenizer (the run's copy, else the corpus directory's), when the
  corpus has one; a synthetic corpus has none and `sample` then prints token ids.

RUN_OR_CKPT: a run directory means its newest checkpoint that verifies; a checkpoints/ or step
directory is used as `minitrain ckpt` uses it. OUT is written as a temporary sibling and renamed
into place: never half-written.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from ..version import __version__
from .. import checkpoint
from ..checkpoint import remote
from ..config import ModelConfig
from ..errors import ConfigError
from ..models.minigpt.model import MiniGPT
from ..parallel.state.placement import check_state, dtype_name
from ..train.metrics import human_bytes
from ..train.resume import saved_run_config
from ..train.run_files import TOKENIZER, copy_tokenizer

WEIGHTS, CONFIG = "model.safetensors", "config.json"
FORMAT = "minitrain-export/1"


def source_step_dir(source: str) -> Path:
    """The checkpoint to export: a run directory's newest verified one (an unverifiable newer one is named on
    stderr), else what PATH resolves to."""
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"{source} does not exist; give a run directory (--out of `minitrain train`) or a "
                          "checkpoint directory")
    if (path / "checkpoints").is_dir():
        skipped: list[str] = []
        try:
            newest = checkpoint.find_latest(path, skipped)
        except checkpoint.CheckpointError:
            raise ConfigError(f"no checkpoint of run {source} verifies ({skipped[-1] if skipped else 'none'}); "
                              "nothing to export") from None
        for note in skipped:
            print(f"minitrain export: note: {note}", file=sys.stderr)
        if newest is None:
            raise ConfigError(f"run {source} has no checkpoint yet; train it to the end (the final save) or with "
                              "--ckpt-every-steps")
        return newest
    return checkpoint.resolve(path)


def check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; OUT is the directory to write, choose another")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} already exists and is not empty; choose another OUT or remove it")
    if not out.parent.is_dir():
        what = "is a file" if out.parent.exists() else "does not exist"
        raise ConfigError(f"{out.parent}, where OUT would go, {what}")


def _check_minigpt(state: dict, model_config: dict, step_dir: Path) -> None:
    """The weights are exactly what the MiniGPT the config describes holds: its keys and shapes (built on the meta
    device, so nothing is allocated); their dtype is the run's."""
    import torch

    with torch.device("meta"):
        model = MiniGPT(ModelConfig(**model_config))
    check_state(state, {k: (list(v.shape), dtype_name(state[k].dtype) if k in state else "")
                        for k, v in model.state_dict().items()},
                f"checkpoint {step_dir} consolidated for MiniGPT", checkpoint.CheckpointError)


def export(source: str, out: str, origin: str | None = None) -> str:
    """origin: where the checkpoint came from, when `source` is a local copy of it (recorded in config.json)."""
    if remote.is_url(source):  # a checkpoint in object storage: fetched, verified, exported, the copy removed
        with remote.local_copy(source) as local:
            return export(local, out, origin=source)
    target = Path(out)
    step_dir = source_step_dir(source)
    check_out(target)
    step_dir, manifest = checkpoint.verify(step_dir)
    run_config = saved_run_config(step_dir, manifest["config"])  # refuses a checkpoint of the Python API
    state = checkpoint.consolidated_state_dict(str(step_dir))
    _check_minigpt(state, run_config["model"], step_dir)
    config = {"format": FORMAT, "model_type": "minigpt", "minitrain_version": __version__,
              "model": run_config["model"], "step": manifest["step"], "source": origin or str(step_dir.resolve()),
              "corpus": run_config["data"]["corpus"], "tokenizer": None}
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        run_copy = step_dir.parent.parent / TOKENIZER  # written at the run's start (run_files.py)
        if run_copy.is_file():
            shutil.copyfile(run_copy, tmp / TOKENIZER)
            config["tokenizer"] = TOKENIZER
        elif copy_tokenizer(run_config["data"]["corpus"], tmp / TOKENIZER):
            config["tokenizer"] = TOKENIZER
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if target.exists():
            target.rmdir()  # checked empty above
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    numel = sum(t.numel() for t in state.values())
    tokenizer = f", tokenizer {target / TOKENIZER}" if config["tokenizer"] else " (no tokenizer: its corpus had none)"
    # Values, not parameters: a tied weight is stored under both of its keys.
    return (f"wrote {target}: {WEIGHTS} ({numel:,} values, {human_bytes((target / WEIGHTS).stat().st_size)}) "
            f"from {origin or step_dir} (step {manifest['step']}), {CONFIG}{tokenizer}")


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("export", help="a run's newest checkpoint as a model directory: weights, config, tokenizer",
                            description="Write OUT: model.safetensors (the consolidated parameters under the model's "
                            "own keys, from any world size or layout), config.json and the corpus's tokenizer.json; "
                            "`minitrain sample OUT` needs nothing else. RUN_OR_CKPT: a run directory (its newest "
                            "checkpoint that verifies) or a checkpoint directory.",
                            epilog="Example:\n  minitrain export runs/notes runs/notes/model",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="RUN_OR_CKPT", help="a run directory, or a checkpoints/ or step-NNNNNN "
                        "directory, or a --ckpt.dir URL (its newest committed checkpoint, or URL/step-NNNNNN)")
    parser.add_argument("out", metavar="OUT", help="the directory to write (must not exist, or be empty)")
    return parser


def run(args) -> int:
    print(export(args.source, args.out))
    return 0
