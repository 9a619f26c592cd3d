"""`minitrain pp-schedule`: a pipeline schedule's timeline on an ideal clock, its bubble and the micro-batches
each stage holds at once (the lists parallel/pipeline_parallel/schedules.py gives the executor)."""
from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..parallel.pipeline_parallel.schedules import SCHEDULES, make_schedule, render_timeline


def add_parser(sub) -> argparse.ArgumentParser:
    pipe = sub.add_parser("pp-schedule", help="a pipeline schedule's timeline, bubble and in-flight micro-batches",
                          description="Print what each pipeline stage does at each tick of an ideal clock (a "
                          "forward takes one tick, communication is free): F3 = forward of micro-batch 3, "
                          "B3 its backward (zero-bubble: its input's gradient, W3 its weights'), . idle. Then "
                          "each stage's bubble against (P-1)/(M+P-1) and the most "
                          "micro-batches whose activations it holds at once. The executor runs the same lists.",
                          epilog="Examples:\n  minitrain pp-schedule --pp 4 --microbatches 8 --schedule 1f1b\n"
                          "  minitrain pp-schedule --pp 4 --microbatches 8 --schedule gpipe --backward-cost 2\n"
                          "  minitrain pp-schedule --pp 4 --microbatches 8 --schedule zero-bubble\n"
                          "  minitrain pp-schedule --pp 4 --microbatches 8 --schedule interleaved --virtual-stages 2",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe.add_argument("--pp", type=int, default=4, metavar="P", help="pipeline stages (default 4)")
    pipe.add_argument("--microbatches", type=int, default=8, metavar="M", help="micro-batches per step (default 8)")
    pipe.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b", help="default 1f1b")
    pipe.add_argument("--virtual-stages", type=int, default=2, metavar="V",
                      help="interleaved: chunks per rank (default 2)")
    pipe.add_argument("--backward-cost", type=int, default=None, metavar="TICKS",
                      help="ticks a backward takes, a forward taking 1 (default 1, and 2 for zero-bubble, which splits "
                      "it into B and W; about 2 in practice)")

    return pipe


def run(args) -> int:
    backward = args.backward_cost if args.backward_cost is not None else 2 if args.schedule == "zero-bubble" else 1
    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches), ("--backward-cost", backward)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if args.schedule == "zero-bubble" and backward < 2:
        raise ConfigError("--schedule zero-bubble splits each backward into B and W: give --backward-cost 2 or more")
    virtual = args.virtual_stages if args.schedule == "interleaved" else 1
    try:
        lists = make_schedule(args.schedule, args.pp, args.microbatches, virtual)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    print(render_timeline(args.schedule, lists, 1, backward))
    return 0
