#!/usr/bin/env python3
"""The capstone, as its text asks for it: `python3 code/main.py`, from the repository's root, after the README's
set-up command (`make demo` or `make install`).

Four ranks (gloo on the CPU, spawned by minitrain's launcher) train the tiny GPT with data parallel + ZeRO-1 for
20 steps on one global batch of synthetic tokens, write a sharded checkpoint at step 10 and go on; then every
rank reloads the step-10 checkpoint in its own process, checks it byte for byte against what it held, trains to
step 20 again and checks every loss and byte against the first run. It prints the 20-row loss table, the 4-row
per-rank memory profile, the checkpoint's manifest, each invariant, and RESUME VERIFIED; exit 0 (1 if an
invariant fails). Outputs go to runs/capstone/ under the current directory.

This is `minitrain demo` written out: the pieces are the library's, one implementation for both.
"""
import os
import sys
from pathlib import Path

try:
    import minitrain  # noqa: F401 - the set-up command installed it into .venv
except ModuleNotFoundError:
    # Run with the system's python3: continue under the repository's virtual environment, if it is made.
    venv = Path(__file__).resolve().parent.parent / ".venv"
    if (venv / "bin" / "python").is_file() and Path(sys.prefix).resolve() != venv.resolve():
        os.execv(str(venv / "bin" / "python"), [str(venv / "bin" / "python"), *sys.argv])
    sys.exit("code/main.py: minitrain is not installed; run `make demo` (or `make install`) from the repository's "
             "root first, or activate .venv")

from minitrain.data import make_corpus  # noqa: E402,F401 - make_corpus(seed, total_tokens): the synthetic tokens
from minitrain.apps.demo import DemoOptions, _train_worker, run_demo, verify_resume  # noqa: E402,F401 - see run_demo
from minitrain.models.minigpt.model import MiniGPT  # noqa: E402,F401 - 2 layers, masked self-attention, separate LM head


def main() -> int:
    """Spawn the ranks (each runs _train_worker, which ends with verify_resume), check the invariants, print the
    report; 0 when every invariant holds."""
    return run_demo(DemoOptions(world_size=4, steps=20, out="runs/capstone"))


if __name__ == "__main__":
    sys.exit(main())
