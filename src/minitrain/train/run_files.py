"""What a run records about itself at its start (rank 0), beside metrics.jsonl:

- config.json: the resolved settings (defaults < preset < file < flags), as `minitrain train
  --config` would read them back;
- env.json: versions, layout, backend, device, the git commit of the directory the run was
  started from (if it is a repository), the command line, and the checkpoint it resumed from;
- tokenizer.json: the tokenizer of the corpus (a prepared directory's, or the byte-level one of
  `--corpus text`), so `minitrain export` can ship it with the weights and `minitrain sample` turn
  ids back into text. Synthetic and bare .bin corpora have none.

A resumed run rewrites them: they describe the run as it is now going on.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from ..version import __version__
from ..corpus import sharded, token_files
from ..config import RunConfig
from ..runtime.topology import Topology

CONFIG, ENVIRONMENT, TOKENIZER = "config.json", "env.json", "tokenizer.json"


def write_run_start(out: Path, cfg: RunConfig, topo: Topology, resumed_from: Path | None) -> None:
    write_json(out / CONFIG, cfg.to_dict())
    write_json(out / ENVIRONMENT, environment(cfg, topo, resumed_from))
    copy_tokenizer(cfg.data.corpus, out / TOKENIZER)


def environment(cfg: RunConfig, topo: Topology, resumed_from: Path | None) -> dict:
    device = topo.device
    return {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "resumed_from": None if resumed_from is None else str(resumed_from),
        "versions": {"minitrain": __version__, "torch": torch.__version__, "numpy": np.__version__,
                     "python": platform.python_version(), "cuda": torch.version.cuda},
        "platform": platform.platform(),
        "world_size": topo.world_size,
        "layout": topo.layout(),
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "git": git_state(Path.cwd()),
    }


def git_state(directory: Path) -> dict | None:
    """{'commit', 'dirty'} of the repository holding `directory`, or None (no git, not a repository)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def copy_tokenizer(corpus: str, target: Path) -> bool:
    """Put the corpus's tokenizer at `target`; False for a corpus that has none."""
    if corpus == "text":
        from ..corpus.tokenizer import (
            byte_level_tokenizer,  # imports `tokenizers` only when there is one to write
        )

        tmp = target.with_name(target.name + ".tmp")
        byte_level_tokenizer().save(str(tmp))
        os.replace(tmp, target)
        return True
    if sharded.is_sharded(corpus):  # a mixture's corpora share a vocabulary: the first one's tokenizer
        store, index = sharded.load_index(corpus.split(",")[0].strip())
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(store.read(index.meta["tokenizer"]))
        os.replace(tmp, target)
        return True
    if token_files.is_prepared_dir(corpus):
        meta = token_files.read_meta(corpus)
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(Path(corpus) / meta["tokenizer"], tmp)
        os.replace(tmp, target)
        return True
    return False


def write_json(path: Path, doc: dict) -> None:
    """`doc` as JSON at `path`, whole or not at all (values JSON has no type for are written as text)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, path)
