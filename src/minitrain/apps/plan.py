"""`minitrain plan`: memory per rank and step time predicted for a model and a layout, before launching
(the planner is minitrain/plan/; this command reads the flags and renders its result)."""
from __future__ import annotations

import argparse
import json

from ..errors import ConfigError
from ..train.metrics import format_table, human_bytes


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
    planner.add_argument("--cp", type=int, default=1, help="context-parallel degree: groups of cp ranks split every "
                         "sequence (activations 1/cp per rank; world = dp x tp x pp x cp; default 1). A plan that "
                         "does not fit says which cp would make the sequence fit")
    planner.add_argument("--cp-style", choices=("ring", "ulysses"), default="ring",
                         help="context-parallel attention (default ring)")
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
    planner.add_argument("--virtual-stages", type=int, default=2, help="--schedule interleaved: chunks per pipeline "
                         "rank (default 2)")
    planner.add_argument("--schedule", choices=("1f1b", "gpipe", "zero-bubble", "interleaved"), default="1f1b",
                         help="pipeline schedule: its bubble (zero-bubble's with F = B = W) and the micro-batches a "
                         "stage holds")
    planner.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed (default 0.4)")
    planner.add_argument("--hardware", choices=("v100-32g", "a100-80g", "h100-sxm", "cpu-here"), default="h100-sxm")
    planner.add_argument("--comm-json", default="runs/bench-comm/comm.json",
                         help="cpu-here: `minitrain bench comm` output to fit alpha and beta from")
    planner.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    return planner


def run(args) -> int:
    from ..config import PRESETS, build_config
    from .. import plan

    for name in ("micro_batch", "grad_accum", "dp", "tp", "pp", "ep", "cp", "microbatches"):
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
        model = build_config(cli_values=values).validate().model  # the settings alone: no corpus is read
        params = plan.model_params(model)
    if args.ep > 1 and (model is None or not model.moe_experts or model.moe_experts % args.ep or args.dp % args.ep):
        raise ConfigError(f"--ep {args.ep} splits a mixture of experts' experts: give --experts E with ep dividing "
                          "E and --dp")
    if args.cp > 1:
        _check_context(args, model)
    if args.schedule == "interleaved" and (args.virtual_stages < 2 or args.microbatches % args.pp):
        raise ConfigError(f"--schedule interleaved needs --virtual-stages 2 or more and --microbatches a multiple of "
                          f"--pp {args.pp}")
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
                         servers=args.servers, staleness=args.staleness, cp=args.cp, cp_style=args.cp_style,
                         virtual_stages=args.virtual_stages if args.schedule == "interleaved" else 1,
                         seq_len=args.model_seq_len or 1024)
    result = plan.plan(inp)
    result["context_needed"] = None if result["fits"] else plan.context_needed(inp)
    print(json.dumps(result) if args.json else render(result))
    return 0


def _check_context(args, model) -> None:
    """--cp against the model and the other degrees, one reason at a time."""
    if model is None:
        raise ConfigError(f"--cp {args.cp} splits a model's sequences: describe the model (--preset), not --params")
    from ..config.dist import context_problem

    clashes = [f for f, on in (("--tp", args.tp > 1), ("--pp", args.pp > 1), ("--ep", args.ep > 1),
                               ("--servers", args.servers > 0)) if on]
    problem = context_problem(args.cp, args.cp_style, model.seq_len, model.n_head, clashes,
                              ("--cp", "--cp-style", "--seq"))
    if problem:
        raise ConfigError(problem)


def render(result: dict) -> str:
    """The plan (minitrain.plan.plan's dict) as text."""
    from ..plan import GB  # the planner is imported when a plan is made (run), not to parse the command line

    inp, b = result["input"], result["bytes_per_rank"]
    kinds = ("params", "grads", "optimizer", "gathered", "activations", "loss_backward", "reduce_copy", "update",
             "total")
    rows = [[kind, human_bytes(b[kind]), f"{b[kind] / GB:.3f}"] for kind in kinds]
    if inp["offload"] != "none":  # rows of state off the device say where it is, and are not in the device's total
        rows[kinds.index("optimizer")][0] = f"optimizer ({'host' if inp['offload'] == 'cpu' else 'disk'})"
        if inp["zero"] >= 2:
            rows[kinds.index("grads")][0] = "grads (host)"
        rows += [[f"{where}, off the device", human_bytes(b[where]), f"{b[where] / GB:.3f}"]
                 for where in ("host", "disk") if b[where]]
    memory = human_bytes(result["device_memory_bytes"])
    experts = f" (ep {inp['ep']}: 1/{inp['ep']} of the experts per rank)" if inp.get("ep", 1) > 1 else ""
    context = f" x cp {inp['cp']} ({inp['cp_style']})" if inp.get("cp", 1) > 1 else ""
    lines = [f"Plan: {result['world_size']} rank(s) = dp {inp['dp']} x tp {inp['tp']} x pp {inp['pp']}{context}"
             f"{experts}, "
             f"ZeRO-{inp['zero']}, "
             f"{inp['precision']}, micro-batch {inp['micro_batch']}, activation checkpointing "
             f"{inp['activation_checkpointing']}, on {inp['hardware']}",
             "", "Memory per rank", format_table(["kind", "bytes", "GB"], rows, "<>>"),
             f"total {human_bytes(b['total'])} of {memory}: " + ("fits" if result["fits"] else "DOES NOT FIT")
             + _context_hint(result),
             "", f"FLOPs per token {result['flops_per_token']:.4g} (with recomputation "
             f"{result['flops_per_token_with_recompute']:.4g}); per rank per step {result['flops_per_rank_step']:.4g}",
             f"compute {1e3 * result['compute_s']:.2f} ms at {100 * result['mfu']:.0f}% MFU of "
             f"{result['peak_flops'] / 1e12:.4g} TFLOP/s; pipeline bubble {100 * result['pipeline_bubble']:.1f}%"]
    if result["communication"]:
        comm = [[r["what"], r["calls"], human_bytes(r["bytes"]), f"{1e3 * r['seconds']:.2f}"]
                for r in result["communication"]]
        lines += ["", "Communication per step (alpha-beta model, no overlap assumed)",
                  format_table(["collective", "calls", "bus bytes", "ms"], comm, "<>>>")]
    if result.get("parameter_servers"):
        lines += _render_servers(result["parameter_servers"])
    lines += ["", f"step {1e3 * result['step_s']:.2f} ms, {result['tokens_per_step']:,} tokens/step, "
                  f"{result['tokens_per_s']:,.0f} tokens/s"]
    return "\n".join(lines)


def _context_hint(result: dict) -> str:
    """What context parallelism would do for a plan that does not fit (`context_needed`)."""
    if result["fits"] or result["input"]["model"] is None:
        return ""
    needed, seq = result.get("context_needed"), result["input"]["model"]["seq_len"]
    if needed is None:
        return (f"; no context-parallel degree up to 64 fits a sequence of {seq} tokens here (the model state "
                "itself may not fit: see ZeRO, offload)")
    ranks = needed // result["input"]["cp"]
    return (f"; a sequence of {seq} tokens fits with --cp {needed} (each rank 1/{needed} of it, {ranks}x the "
            "ranks)") if needed > result["input"]["cp"] else ""


def _render_servers(s: dict) -> list[str]:
    """The parameter servers' summary (plan/servers.py) as text lines."""
    held = s["bytes_per_server"]
    needed = ("no number of servers beats it on these links: a worker's link carries its gradient, then the "
              "parameters, where a ring's carries 2(W-1)/W of the gradient" if s["servers_needed"] is None
              else f"the fewest servers that would beat it: {s['servers_needed']} (each server's link carries W/S "
              "of every worker's bytes, each server adds a message latency)")
    faster = "faster" if s["push_pull_s"] < s["ring_all_reduce_s"] else "slower"
    return ["", f"Parameter servers: {s['workers']} worker(s), {s['servers']} server(s), staleness bound K = "
                f"{s['staleness']}",
            f"push + pull {1e3 * s['push_pull_s']:.2f} ms per step, {faster} than a ring all-reduce of the same "
            f"gradient over the workers ({1e3 * s['ring_all_reduce_s']:.2f} ms); {needed}",
            f"each server holds {human_bytes(sum(held.values()))}: parameters {human_bytes(held['params'])}, "
            f"optimizer {human_bytes(held['optimizer'])}, gradients waiting for their step "
            f"{human_bytes(held['held_gradients'])}; a worker holds no optimizer state"]
