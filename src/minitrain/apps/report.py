"""`minitrain report RUN_DIR [RUN_DIR...]`: plots and a text summary of finished (or running) runs.

Reads each RUN_DIR/metrics.jsonl that `minitrain train --out RUN_DIR` writes (rank 0), draws one PNG per
quantity with one line per run, and prints per run what a reader asks first: how far it got, how low the
loss went, how fast it ran, where a step's time went, how much memory each rank peaked at. Every input is
checked before anything is written, so a refused report leaves no half-written directory behind.

The command is this file; what it reads and prints is report_data.py, what it draws report_plots.py.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError
from .report_data import MULTI_RUN_OUT, check_out_dir, metrics_path, read_run, summary_text, unique_labels
from .report_plots import write_plots

DESCRIPTION = ("Plot and summarise training runs from the metrics.jsonl that `minitrain train --out RUN_DIR` "
               "writes. Several runs share each plot, one line per run, and get a comparison table.")

EPILOG = """\
Examples:
  minitrain report runs/a                           # writes runs/a/report/
  minitrain report runs/z1 runs/z3 --out runs/zero  # two runs on the same axes, plus a table comparing them
  minitrain train --nproc 2 --steps 50 --out runs/b && minitrain report runs/b
  minitrain report runs/c                           # while runs/c still trains: what is logged so far

Writes under --out:
  loss.png          train loss (and validation loss, dashed with markers, where it ran) against tokens seen
  lr.png            learning rate against step
  grad_norm.png     gradient norm (before clipping) against step
  tokens_per_s.png  throughput against step
  memory.png        peak tracked bytes per rank (parameters, gradients, optimizer state) against step
  comm_share.png    share of each step spent in communication
  report.png        the six panels at once, for a quick look
  summary.txt       the summary printed on stdout

Speed (median tokens/s, mean step time, comm share) counts the steps after the first 5, which pay for
warm-up; a run of 5 steps or fewer is counted whole. Lines cut short by a crash are skipped, and a step
logged twice (a rollback replays steps) counts once, as last logged.
"""


# --- reading --------------------------------------------------------------------------------------


# --- the command ----------------------------------------------------------------------------------

def add_parser(sub) -> argparse.ArgumentParser:
    """`minitrain report` on the CLI's subparsers (whose parser_class is apps/cli.py's Parser)."""
    parser = sub.add_parser("report", help="plots and a summary of one or more runs, compared",
                            description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="the --out of a `minitrain train` run (it holds metrics.jsonl), or that metrics.jsonl")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help=f"where to write plots and summary.txt (default: RUN_DIR/report for one run, "
                             f"{MULTI_RUN_OUT} for several)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Check every input, then write the plots and summary.txt and print the summary. ConfigError on bad
    input, raised before anything is written."""
    paths = [metrics_path(d) for d in args.run_dirs]
    runs = [read_run(path, label) for path, label in zip(paths, unique_labels(paths))]
    text = summary_text(runs)
    out = Path(args.out) if args.out else (paths[0].parent / "report" if len(paths) == 1 else MULTI_RUN_OUT)
    check_out_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write the report to {out}: {e.strerror or e}; choose another --out") from None

    (out / "summary.txt").write_text(text)
    drawn, empty = write_plots(runs, out)
    print(text, end="")
    drawn = [f"{name}.png" for name in drawn] + ["report.png", "summary.txt"]
    print(f"\nwrote {out}/: {' '.join(drawn)}")
    if empty:
        print(f"left out for lack of data: {', '.join(f'{name}.png' for name in empty)}")
    return 0
