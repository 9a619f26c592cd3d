"""`minitrain plan`: memory per rank and step time predicted for a model and a layout, before launching
(the estimator is train/estimate.py)."""
from __future__ import annotations

import argparse
import json

from ..errors import ConfigError


def add_parser(sub) -> argparse.ArgumentParser:
    planner = sub.add_parser("plan", help="memory per rank and step time, before launching",
                             description="Predict per-rank bytes (parameters, gradients, optimizer state, "
                             "activations) and the step time (compute at an MFU, each collective from an "
                             "alpha-beta model, pipeline bubble) for a model and a layout. Describe the model by "
                             "--preset (with overrides) or by a raw --params count.",
                             epilog="Examples:\n  minitrain plan --preset gpt2-124m --dp 8 --zero 1 --precision bf16\n"
                             "  minitrain plan --params 7.5e9 --dp 64 --zero 3 --precision fp16 --reduce-dtype compute  # the ZeRO paper's "
                             "example\n  minitrain bench comm --out runs/bench-comm && minitrain plan --hardware "
                             "cpu-here --dp 2 --zero 1", formatter_class=argparse.RawDescriptionHelpFormatter)
    planner.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    for flag, field_name in (("--layers", "n_layer"), ("--d-model", "d_model"), ("--heads", "n_head"),
                             ("--vocab", "vocab_size"), ("--seq", "seq_len"), ("--d-ff", "d_ff"),
                             ("--experts", "moe_experts"), ("--top-k", "moe_top_k")):
        planner.add_argument(flag, dest=f"model_{field_name}", type=int, help=f"override the preset's {field_name}")
    planner.add_argument("--params", type=float, help="a raw parameter count instead of a model (e.g. 7.5e9); "
                         "activations are then not estimated")
    planner.add_argument("--micro-batch", type=int, default=1, help="examples per rank per micro-batch (default 1)")
    planner.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    planner.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    planner.add_argument("--reduce-dtype", choices=("fp32", "compute"), default="fp32",
                         help="what gradients are summed in with bf16/fp16 (the ZeRO paper's figures: compute)")
    for flag in ("--dp", "--tp", "--pp"):
        planner.add_argument(flag, type=int, default=1, help="parallel degree (default 1)")
    planner.add_argument("--ep", type=int, default=1, help="expert-parallel degree of a mixture of experts (divides "
                         "--dp and --experts): each rank holds 1/ep of every layer's experts (default 1)")
    planner.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    planner.add_argument("--activation-checkpointing", choices=("none", "block", "selective"), default="none")
    planner.add_argument("--offload", choices=("none", "cpu", "disk"), default="none",
                         help="the optimizer's master and state in host memory (cpu) or files (disk), and at ZeRO-2/3 "
                         "the gradient shard in host memory: off the device's total")
    planner.add_argument("--servers", type=int, default=0, help="parameter servers besides the --dp workers: the "
                         "workers push gradients and pull parameters instead of an all-reduce, the servers hold the "
                         "optimizer; says how many servers beat the all-reduce on these links (default 0)")
    planner.add_argument("--staleness", type=int, default=0, help="the servers' staleness bound K (what they hold of "
                         "gradients waiting for their step; default 0)")
    planner.add_argument("--microbatches", type=int, default=1, help="pipeline micro-batches (default 1)")
    planner.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    planner.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed (default 0.4)")
    planner.add_argument("--hardware", choices=("v100-32g", "a100-80g", "h100-sxm", "cpu-here"), default="h100-sxm")
    planner.add_argument("--comm-json", default="runs/bench-comm/comm.json",
                         help="cpu-here: `minitrain bench comm` output to fit alpha and beta from")
    planner.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    return planner


def run(args) -> int:
    from ..config import PRESETS
    from ..train import estimate as plan
    from ..train.run_config import run_config

    for name in ("micro_batch", "grad_accum", "dp", "tp", "pp", "ep", "microbatches"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must lie in (0, 1], got {args.mfu}")
    if args.params is not None:
        if not args.params >= 1:
            raise ConfigError(f"--params must be a positive count, got {args.params:g}")
        model, params = None, args.params
    else:
        if args.preset not in PRESETS:
            raise ConfigError(f"unknown preset '{args.preset}'; choose one of: {', '.join(PRESETS)}")
        overrides = {k.removeprefix("model_"): v for k, v in vars(args).items() if k.startswith("model_") and v}
        values = {"model.preset": args.preset, **{f"model.{k}": v for k, v in overrides.items()}}
        model = run_config(cli_values=values).model
        params = plan.model_params(model)
    if args.ep > 1 and (model is None or not model.moe_experts or model.moe_experts % args.ep or args.dp % args.ep):
        raise ConfigError(f"--ep {args.ep} splits a mixture of experts' experts: give --experts E with ep dividing "
                          "E and --dp")
    if args.servers < 0 or args.staleness < 0:
        raise ConfigError("--servers and --staleness must be >= 0")
    if args.servers and (args.zero or args.tp > 1 or args.pp > 1 or args.ep > 1 or args.offload != "none"):
        raise ConfigError("--servers plans parameter servers for data-parallel workers; they do not combine with "
                          "--zero, --tp, --pp, --ep or --offload")
    if args.staleness and not args.servers:
        raise ConfigError("--staleness needs parameter servers (--servers S)")
    hardware = plan.cpu_here(args.comm_json) if args.hardware == "cpu-here" else plan.PRESETS[args.hardware]
    inp = plan.PlanInput(model=model, params=params, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                         precision=args.precision, reduce_dtype=args.reduce_dtype, dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep, zero=args.zero,
                         activation_checkpointing=args.activation_checkpointing, microbatches=args.microbatches,
                         schedule=args.schedule, mfu=args.mfu, hardware=hardware, offload=args.offload,
                         servers=args.servers, staleness=args.staleness,
                         seq_len=args.model_seq_len or 1024)
    result = plan.plan(inp)
    print(json.dumps(result) if args.json else plan.render(result))
    return 0
