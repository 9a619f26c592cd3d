"""What every result file records besides its figures: the command that reproduces it and the machine it ran on.

The tables in README.md and docs/ are generated from these files (benchmarks/tables.py), so a figure can always be
traced to the run that produced it and rerun the same way.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def command(script: str, argv: list[str] | None) -> str:
    """The command line, from the repository root, that reruns `script` (in benchmarks/ or tools/) with these
    arguments."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", Path(script).resolve().relative_to(RESULTS.parent.parent).as_posix(), *args])


def _cpu_model() -> str:
    # platform.processor() is empty on most Linux systems; /proc/cpuinfo names the CPU there.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(**versions: str) -> dict:
    """Platform, CPU model, logical CPUs, torch and Python versions, plus any other library's `versions`."""
    import torch  # every benchmark has it loaded already; imported here so command() stays light

    return {"platform": platform.platform(), "processor": _cpu_model(), "cpus": os.cpu_count(),
            "torch": torch.__version__, **versions, "python": platform.python_version()}


def write_result(path: str | os.PathLike, script: str, argv: list[str] | None, body: dict,
                 **versions: str) -> Path:
    """Write {"command", "machine", "date", **body} as JSON to `path`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")  # when: a table shows which run its figures are from
    path.write_text(json.dumps({"command": command(script, argv), "machine": machine(**versions), "date": date,
                                **body}, indent=1))
    return path
