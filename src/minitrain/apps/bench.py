"""`minitrain bench scaling | comm | throughput`: measurements that write their figures, plots and raw timings to
--out (the work itself is in minitrain.bench)."""
from __future__ import annotations

import argparse

from ..bench.comm import OPS as COMM_OPS
from ..errors import ConfigError
from .out_dir import prepare_out_dir


def add_parser(sub) -> argparse.ArgumentParser:
    bench = sub.add_parser("bench", help="measurements: scaling, comm, throughput", description="Measurements that write their "
                           "figures, plots and raw timings to a directory.")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench), metavar="BENCH")
    scaling = bench_sub.add_parser("scaling", help="tokens/s with 1 vs N processes, and why",
                                   description="Train the same model with 1 and with 2 processes (4 with "
                                   "--max-procs 4), gloo on CPU, and explain the measured scaling from the "
                                   "compute and communication times. Writes timings.jsonl, "
                                   "state-rank-*.safetensors, scaling.png and manifest.json under --out.")
    scaling.add_argument("--out", default="runs/scaling", metavar="DIR", help="output directory (default runs/scaling)")
    scaling.add_argument("--steps", type=int, default=100, help="steps per run (default 100)")
    scaling.add_argument("--max-procs", type=int, default=2, choices=(2, 4), help="largest world size (default 2)")
    scaling.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    scaling.add_argument("--batch-size", type=int, default=4, help="examples per rank per step (default 4)")
    comm = bench_sub.add_parser("comm", help="time, algbw and busbw of each collective; alpha-beta fit",
                                description="Time all_reduce, all_gather, reduce_scatter, broadcast and all_to_all "
                                "from 1 KiB to --max-mb MiB on N ranks (gloo on CPU, NCCL with a GPU per rank); "
                                "report algbw and busbw as nccl-tests defines them, and fit t = alpha + factor*S/beta "
                                "per op. Writes comm.json and comm.png under --out.")
    comm.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks (default 2)")
    comm.add_argument("--max-mb", type=float, default=64.0, metavar="M", help="largest size in MiB (default 64)")
    comm.add_argument("--ops", nargs="+", choices=COMM_OPS, default=list(COMM_OPS), metavar="OP",
                      help=f"a subset of: {' '.join(COMM_OPS)} (default all)")
    comm.add_argument("--out", default="runs/bench-comm", metavar="DIR", help="output directory (default runs/bench-comm)")
    speed = bench_sub.add_parser(
        "throughput", help="one process: minitrain's trainer against a plain PyTorch loop; tokens/s and MFU",
        description="Train the same model (same weights, data, schedule, clipping) with minitrain's trainer and "
        "with the loop a PyTorch user writes (fused AdamW, clip_grad_norm_, autocast), alternating in rounds; "
        "report tokens/s of each, their ratio, and MFU (6N + 12LhT FLOPs per token over the device's peak: the "
        "data sheet on A100/H100/H200, a measured matrix multiply elsewhere). Writes throughput.json under --out.",
        epilog="Example: minitrain bench throughput --preset small --precision fp32 bf16; on a GPU: minitrain bench "
        "throughput --preset gpt2-124m --precision bf16 --compile")
    speed.add_argument("--preset", default="small", help="model preset: tiny | small | gpt2-124m (default small)")
    speed.add_argument("--precision", nargs="+", default=["fp32"], metavar="P",
                       help="one configuration per value: fp32 | bf16 (default fp32)")
    speed.add_argument("--compile", action="store_true", help="torch.compile each block, on both sides")
    speed.add_argument("--batch-size", type=int, default=8, help="examples per step (default 8)")
    speed.add_argument("--steps", type=int, default=5, help="measured steps per side and round (default 5)")
    speed.add_argument("--rounds", type=int, default=3, help="rounds, alternating which side goes first (default 3)")
    speed.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side first (default 2)")
    speed.add_argument("--late-stats", default="auto", choices=("auto", "on", "off"),
                       help="ours: read each step's statistics while the next step runs (--train.late_stats; "
                       "default auto: on a GPU)")
    speed.add_argument("--out", default="runs/bench-throughput", metavar="DIR",
                       help="output directory (default runs/bench-throughput)")

    return bench


def run(args) -> int:
    from ..bench.scaling import ScalingOptions, run_scaling

    if args.bench == "throughput":
        from ..bench.throughput import (
            ThroughputOptions,
            check_throughput_options,
            run_throughput,
        )

        opts = ThroughputOptions(out=args.out, preset=args.preset, precisions=args.precision, compile=args.compile,
                                 batch_size=args.batch_size, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                                 late_stats=args.late_stats)
        check_throughput_options(opts)
        prepare_out_dir(args.out)
        return run_throughput(opts)
    if args.bench == "comm":
        from ..bench.comm import CommOptions, check_comm_options, run_comm

        opts = CommOptions(nproc=args.nproc, max_mb=args.max_mb, out=args.out, ops=tuple(args.ops))
        check_comm_options(opts)
        prepare_out_dir(args.out)
        return run_comm(opts)
    if args.steps < 10:
        raise ConfigError(f"bench scaling needs at least 10 steps to measure past warmup (got --steps {args.steps})")
    prepare_out_dir(args.out)
    return run_scaling(ScalingOptions(out=args.out, steps=args.steps, max_procs=args.max_procs,
                                      preset=args.preset, batch_size=args.batch_size))
