"""`minitrain COMMAND`: one module per command, each owning its parser (add_parser) and its work (run); this file
assembles them and turns failures into exit codes. Bad input exits 2 with one line saying what to fix, before
anything is written; a failed rank exits 1 with that rank's traceback, shown once; Ctrl-C exits 130.
"""
from __future__ import annotations

import argparse
import sys

from .. import checkpoint
from ..config import ConfigError
from ..corpus import prepare as prepare_data
from ..runtime.launch import LaunchTimeoutError, RankFailedError
from ..version import __version__
from . import bench, ckpt, demo, export, plan, pp_schedule, report, sample, train

# `minitrain --help` lists them in this order.
COMMANDS = (demo, train, prepare_data, report, export, sample, ckpt, plan, pp_schedule, bench)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> Parser:
    parser = Parser(prog="minitrain", description="Small, exactly correct distributed training for GPT-style models.")
    parser.add_argument("--version", action="version", version=f"minitrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub).set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, checkpoint.CheckpointError) as e:
        print(f"minitrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (RankFailedError, LaunchTimeoutError) as e:
        print(f"minitrain {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"minitrain {args.command}: interrupted{train.what_is_lost(args)}", file=sys.stderr)
        return 130


# Kept importable from here: tests and scripts build a training config as the command line does.
resolve_config = train.resolve_config
