"""`make bench`: rerun every benchmark behind a table in README.md or docs/, then regenerate the tables.

Each result file in benchmarks/results/ records the command that wrote it (record.py); this reruns those commands,
one after another, so every figure in the docs comes from a run of this checkout on this machine. Left out, and
said so: the GPU results (tools/gpu_session.sh on a machine with a GPU writes them) and the historical ones (a
"before" measured on an older checkout, which this one cannot be). A command that fails is reported and the rest
still run; the exit code is 1 if any failed.

    python benchmarks/run_all.py            # every command, then benchmarks/tables.py
    python benchmarks/run_all.py --list     # what would run, and what is left out and why
    python benchmarks/run_all.py --only throughput.json param_server.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from record import RESULTS  # benchmarks/record.py

ROOT = RESULTS.parent.parent


def why_left_out(name: str, command: str) -> str | None:
    """Why a result file's command is not rerun here, or None."""
    if command.startswith("OUT="):
        return "a GPU session's (tools/gpu_session.sh)"
    if "--before" in command or "before" in name:
        return "historical: measured on an older checkout"
    words = shlex.split(command)
    if "--nanogpt" in words and not Path(words[words.index("--nanogpt") + 1]).is_dir():
        return "needs a checkout of karpathy/nanoGPT where --nanogpt says (fetch it, then rerun with its path)"
    return None


def commands() -> dict[str, tuple[str, str | None]]:
    """Each result file's name -> (its command, why it is left out or None). Files that share a command (one
    script writing several) run it once."""
    out, seen = {}, set()
    for path in sorted(RESULTS.glob("*.json")):
        command = json.loads(path.read_text()).get("command", "")
        reason = why_left_out(path.name, command) if command else "records no command"
        if reason is None and command in seen:
            reason = "written by the same command as another file"
        seen.add(command)
        out[path.name] = (command, reason)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="say what would run and what is left out, run nothing")
    parser.add_argument("--only", nargs="+", metavar="FILE", help="only the commands of these result files")
    args = parser.parse_args(argv)
    todo = commands()
    if args.only:
        unknown = sorted(set(args.only) - set(todo))
        if unknown:
            print(f"run_all: no result file {', '.join(unknown)} in {RESULTS.relative_to(ROOT)}", file=sys.stderr)
            return 2
        todo = {name: todo[name] for name in args.only}
    failed = []
    for name, (command, reason) in todo.items():
        if reason is not None:
            print(f"left out  {name}: {reason}")
            continue
        if args.list:
            print(f"would run {name}: {command}")
            continue
        print(f"running   {name}: {command}", flush=True)
        began = time.monotonic()
        argv_ = shlex.split(command)
        argv_[0] = sys.executable  # "python" as recorded: this interpreter, with its environment
        result = subprocess.run(argv_, cwd=ROOT)
        print(f"          {'done' if result.returncode == 0 else f'FAILED (exit {result.returncode})'} in "
              f"{time.monotonic() - began:.0f} s", flush=True)
        if result.returncode:
            failed.append(name)
    if not args.list:
        subprocess.run([sys.executable, str(Path(__file__).with_name("tables.py"))], cwd=ROOT, check=True)
    if failed:
        print(f"run_all: {len(failed)} command(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
