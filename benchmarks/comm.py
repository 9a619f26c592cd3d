"""`minitrain bench comm` at several world sizes, kept as result files for the table in docs/comm.md.

Each world size runs the command's measurement (every collective, 1 KiB to --max-mb MiB, timed between
barriers, alpha-beta fit; see src/minitrain/bench/comm.py) and its comm.json is kept whole.

    .venv/bin/python benchmarks/comm.py [--worlds 2 4] [--max-mb 64]

Writes benchmarks/results/comm_n{N}.json (command, machine, the comm.json report).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.bench.comm import CommOptions, run_comm


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mb", type=float, default=64.0)
    args = parser.parse_args(argv)
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as out:
            run_comm(CommOptions(nproc=world, max_mb=args.max_mb, out=out))
            report = json.loads((Path(out) / "comm.json").read_text())
        print(f"wrote {write_result(RESULTS / f'comm_n{world}.json', __file__, argv, report)}")


if __name__ == "__main__":
    main()
