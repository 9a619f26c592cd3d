"""The figures only a GPU gives, in one process group on one CUDA device (gpt2-124m, bf16):

- memory: `minitrain plan`'s predicted peak per rank against `torch.cuda.max_memory_allocated` over a step (after
  a warm-up step), at ZeRO 0 and 3, without and with block activation checkpointing;
- timings on NCCL (world 1, a real process group whose collectives are issued, not skipped): the step time, the collectives' time from device events, the
  overlap of the gradient sync with backward, the busy time, and how much of the step the timed phases cover;
- offload: the step time with the optimizer's master and state in host memory (`--train.offload cpu`) as a ratio
  to the state on the device, at ZeRO 0 and 2;
- where a step's device time goes: the top kernels of one step under torch.profiler;
- against the plain PyTorch loop of `minitrain bench throughput` (batch 16): the device's busy time per step
  (the union of its kernels) beside the wall time, the device's idle time by what the host was doing meanwhile,
  and the kernels where the two differ most: what the gap between them is made of; ours stepped as the run loop
  steps (statistics read while the next step runs) and read at once;
- what is allocated at the peak of a ZeRO-0 step, with and without block recomputation, beside the plan's terms.

Throughput and MFU against a plain loop are `minitrain bench throughput` (its own results file).

    python benchmarks/gpu.py [--batch 8] [--steps 5] [--out FILE]

Writes benchmarks/results/gpu.json (or --out). Needs a CUDA device; exits 2 without one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.runtime.launch import launch
from minitrain import plan
from minitrain.train.metrics import format_table, human_bytes
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

PRESET = "gpt2-124m"


def _values(batch: int, **extra) -> dict:
    return {"model.preset": PRESET, "train.precision": "bf16", "train.batch_size": batch, "train.log_every": 0,
            "train.spike_factor": 0.0, **extra}


def memory_rows(topo, batch: int) -> list[dict]:
    rows = []
    for zero in (0, 3):
        for ac in ("none", "block"):
            cfg = run_config(cli_values=_values(batch, **{"train.zero": zero, "train.activation_checkpointing": ac}))
            with Trainer(cfg, topo) as trainer:
                trainer.train_step()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                trainer.train_step()
                torch.cuda.synchronize()
                measured = torch.cuda.max_memory_allocated()
            torch.cuda.empty_cache()
            predicted = plan.plan(plan.PlanInput(model=cfg.model, params=plan.model_params(cfg.model), zero=zero,
                                                 micro_batch=batch, precision="bf16", activation_checkpointing=ac))
            total = predicted["bytes_per_rank"]["total"]
            rows.append({"zero": zero, "activation_checkpointing": ac, "predicted_bytes": total,
                         "measured_bytes": measured, "error": total / measured - 1})
    return rows


def timing_rows(topo, batch: int, steps: int) -> list[dict]:
    rows = []
    for zero, offload in ((0, "none"), (0, "cpu"), (2, "none"), (2, "cpu"), (3, "none")):
        cfg = run_config(cli_values=_values(batch, **{"train.zero": zero, "train.offload": offload}))
        with Trainer(cfg, topo) as trainer:
            trainer.train_step()
            records = [trainer.train_step() for _ in range(steps)]
        torch.cuda.empty_cache()
        med = lambda f: statistics.median(f(r) for r in records)  # noqa: E731
        phases = {name: med(lambda r: r.phases_s[name] or 0.0) for name in records[-1].phases_s}
        rows.append({"zero": zero, "offload": offload, "step_s": med(lambda r: r.step_time_s),
                     "tokens_per_s": med(lambda r: r.tokens_per_s), "comm_s": med(lambda r: r.comm_time_s),
                     "comm_calls": records[-1].comm_calls, "busy_s": med(lambda r: r.busy_s_per_rank[0]),
                     "overlap": (records[-1].sync or {}).get("overlap"), "phases_s": phases,
                     "timed_share": 1 - phases["other"] / med(lambda r: r.step_time_s)})
    return rows


def top_kernels(topo, batch: int, count: int = 15) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with Trainer(run_config(cli_values=_values(batch)), topo) as trainer:
        trainer.train_step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train_step()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0 and not _annotation(e)]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"name": e.key[:90], "calls": e.count, "device_ms": e.self_device_time_total / 1000,
             "share": e.self_device_time_total / total if total else 0.0} for e in events[:count]]


def _annotation(event) -> bool:
    """Whether a profiler event is a label's span (record_function), not device work."""
    return bool(getattr(event, "is_user_annotation", False)) or event.key.startswith(("minitrain.", "Optimizer."))


def _kernel_times(step, steps: int = 3) -> dict:
    """Over `steps` calls of step() under torch.profiler: wall seconds per step, the device's busy seconds per step
    (the union of its kernels' and copies' intervals), seconds per step by kernel name, and the device's idle time
    by what the host was doing meanwhile (the innermost host operation open at the middle of each gap)."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - began) / steps
    events = prof.events()
    # Device activity: kernels, copies and sets; not the per-operator device totals the profiler also lists, nor
    # the spans of record_function's labels on the device's timeline (minitrain.forward, Optimizer.step#...),
    # which cover the gaps between their kernels.
    device = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and not e.name.startswith("aten::")
                     and not _annotation(e)), key=lambda t: t[0])
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CPU]
    by_name: dict[str, float] = {}
    calls: dict[str, float] = {}
    for a, b, name in device:
        by_name[name] = by_name.get(name, 0.0) + (b - a) / 1e6 / steps
        calls[name] = calls.get(name, 0) + 1 / steps
    busy, gaps, end = 0.0, [], None  # microseconds
    for a, b, _ in device:
        if end is not None and a > end:
            gaps.append((end, a))
        if end is None or a > end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    idle_by_phase: dict[str, float] = {}  # the trainer's phase (step_timer.py's labels) open on the host meanwhile
    idle_by_op: dict[str, float] = {}  # the innermost host operation open meanwhile
    for a, b in gaps:
        if b - a < 5:  # launch latency between back-to-back kernels
            continue
        middle = (a + b) / 2
        open_ops = sorted((hb - ha, name) for ha, hb, name in host if ha <= middle <= hb)
        phase = next((name for _, name in open_ops if name.startswith("minitrain.")), "(outside the phases)")
        op = open_ops[0][1] if open_ops else "(python only)"
        for table, key in ((idle_by_phase, phase), (idle_by_op, op)):
            table[key] = table.get(key, 0.0) + (b - a) / 1e6 / steps
    top = lambda table: dict(sorted(table.items(), key=lambda kv: -kv[1])[:10])  # noqa: E731
    return {"wall_s": wall, "busy_s": busy / 1e6 / steps, "by_name": by_name, "calls": calls,
            "idle_by_phase": top(idle_by_phase),
            "idle_by_op": top(idle_by_op)}


def against_plain(topo, batch: int = 16) -> dict:
    """Ours as the run loop steps (launch_step: on a GPU the statistics are read while the next step runs) and
    read at once (train_step), against the plain loop."""
    from minitrain.bench.throughput import PlainLoop, ThroughputOptions, bench_config

    cfg = bench_config(ThroughputOptions(preset=PRESET, precisions=["bf16"], batch_size=batch), "bf16")
    with Trainer(cfg, topo.single(topo.device)) as trainer:
        ours = _kernel_times(trainer.launch_step)
        trainer.settle()
        at_once = _kernel_times(trainer.train_step)
    plain = _kernel_times(PlainLoop(cfg, topo.device).train_step)
    names = set(ours["by_name"]) | set(plain["by_name"])
    diff = sorted(((ours["by_name"].get(n, 0.0) - plain["by_name"].get(n, 0.0), n) for n in names), reverse=True)
    summary = lambda k: {key: k[key] for key in ("wall_s", "busy_s", "idle_by_phase", "idle_by_op")}  # noqa: E731
    row = lambda d, n: {"name": n[:90], "extra_ms": 1000 * d, "calls": round(ours["calls"].get(n, 0)),  # noqa: E731
                        "plain_calls": round(plain["calls"].get(n, 0))}
    return {"batch": batch, "late_stats": trainer.late_stats, "ours": summary(ours), "ours_read_at_once":
            summary(at_once), "plain": summary(plain),
            "kernels_more": [row(d, n) for d, n in diff[:20]], "kernels_less": [row(d, n) for d, n in diff[-8:]]}


def peak_composition(topo, batch: int, zero: int, checkpointing: str, count: int = 12) -> dict:
    """What is allocated at the step's peak (torch.cuda.memory's allocation history): the largest live blocks with
    where each was allocated, beside the plan's terms; for the memory rows the plan misses most."""
    cfg = run_config(cli_values=_values(batch, **{"train.zero": zero, "train.activation_checkpointing": checkpointing}))
    with Trainer(cfg, topo) as trainer:
        trainer.train_step()
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        trainer.train_step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        at_rest = {k: int(v) for k, v in trainer.strategy.memory_bytes().items()}
    torch.cuda.empty_cache()
    live, total, peak, at_peak = {}, 0, 0, {}
    before = sum(b["size"] for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
        elif event["action"] == "free_requested":  # also of blocks allocated before the recording began
            total -= event["size"]
            live.pop(event["addr"], None)
        if total > peak:
            peak, at_peak = total, dict(live)
    largest = sorted(at_peak.values(), key=lambda v: -v[0])[:count]
    predicted = plan.plan(plan.PlanInput(model=cfg.model, params=plan.model_params(cfg.model), zero=zero,
                                         micro_batch=batch, precision="bf16", activation_checkpointing=checkpointing,
                                         hardware=plan.PRESETS["h100-sxm"]))["bytes_per_rank"]
    return {"zero": zero, "activation_checkpointing": checkpointing, "allocated_at_end": before, "at_rest": at_rest,
            "peak_over_start": peak, "largest_at_peak": [{"bytes": size, "where": where} for size, where in largest],
            "plan": predicted}


def _where(frames: list[dict]) -> str:
    """The allocation's innermost frames in this project or torch.nn, as file:line function."""
    picked = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames
              if "minitrain" in f["filename"] or "torch/nn" in f["filename"] or "autograd" in f["filename"]]
    return " < ".join(picked[:3]) or (frames[0]["name"] if frames else "?")


def _measure(topo, batch: int, steps: int, partial: str, only: list[str] | None = None) -> dict:
    """Every section in turn; after each, what is measured so far goes to `partial` (JSON), so that a run stopped
    at its time limit still leaves the sections it finished."""
    import json

    topo = topo.issuing_alone()  # every collective through NCCL, as at world > 1, so that its costs show
    body = {"device": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "backend": topo.backend}
    sections = {"memory": lambda: memory_rows(topo, batch), "timings": lambda: timing_rows(topo, batch, steps),
                "top_kernels": lambda: top_kernels(topo, batch), "against_plain": lambda: against_plain(topo),
                "peak": lambda: [peak_composition(topo, batch, 0, "block"), peak_composition(topo, batch, 0, "none")]}
    for name, measure in sections.items():
        if only and name not in only:
            continue
        body[name] = measure()
        with open(partial, "w") as f:
            json.dump(body, f, indent=1, default=str)
        print(f"benchmarks/gpu.py: {name} measured", flush=True)
    return body


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="examples per step (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per timing row (default 5)")
    parser.add_argument("--out", default=str(RESULTS / "gpu.json"))
    parser.add_argument("--only", nargs="+", metavar="SECTION", help="measure these sections only (memory, timings, "
                        "top_kernels, against_plain, peak) and print their figures; a check, not a results file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: error: no CUDA device here", file=sys.stderr)
        sys.exit(2)
    [body] = launch(_measure, 1, args.batch, args.steps, args.out + ".partial", args.only, backend="nccl",
                    threads_per_rank=16, timeout_s=900)
    if args.only:
        print(json.dumps(body, indent=1, default=str))
        return
    body.update(preset=PRESET, batch=args.batch, precision="bf16")
    path = write_result(args.out, __file__, argv, body)
    print(f"{body['device']}, CUDA {body['cuda']}, NCCL {body['nccl']}, {PRESET} bf16, batch {args.batch}")
    print(format_table(["ZeRO", "checkpointing", "plan", "max_memory_allocated", "plan error"],
                       [[r["zero"], r["activation_checkpointing"], human_bytes(r["predicted_bytes"]),
                         human_bytes(r["measured_bytes"]), f"{r['error']:+.1%}"] for r in body["memory"]]))
    base = {r["zero"]: r["step_s"] for r in body["timings"] if r["offload"] == "none"}
    print(format_table(["ZeRO", "offload", "step ms", "vs none", "tok/s", "comm ms", "calls", "overlap", "busy ms",
                        "phases cover"],
                       [[r["zero"], r["offload"], f"{1000 * r['step_s']:.1f}", f"{r['step_s'] / base[r['zero']]:.2f}x",
                         f"{r['tokens_per_s']:,.0f}", f"{1000 * r['comm_s']:.2f}", r["comm_calls"],
                         "-" if r["overlap"] is None else f"{r['overlap']:.0%}", f"{1000 * r['busy_s']:.1f}",
                         f"{r['timed_share']:.0%}"] for r in body["timings"]]))
    print(format_table(["kernel", "calls", "device ms", "share"],
                       [[k["name"], k["calls"], f"{k['device_ms']:.2f}", f"{k['share']:.1%}"]
                        for k in body["top_kernels"]]))
    vs = body["against_plain"]
    for side in ("ours", "ours_read_at_once", "plain"):
        k = vs[side]
        print(f"{side}, batch {vs['batch']}: wall {1000 * k['wall_s']:.1f} ms/step, device busy "
              f"{1000 * k['busy_s']:.1f}; device idle (ms/step) by the host's phase: "
              + ", ".join(f"{name} {1000 * ms:.2f}" for name, ms in k["idle_by_phase"].items())
              + "; by its operation: "
              + ", ".join(f"{name[:40]} {1000 * ms:.2f}" for name, ms in k["idle_by_op"].items()))
    for p in body["peak"]:
        print(f"peak, ZeRO-{p['zero']} {p['activation_checkpointing']}: {human_bytes(p['peak_over_start'])} over "
              f"{human_bytes(p['allocated_at_end'])} at the step's end; plan {p['plan']}")
        for block in p["largest_at_peak"]:
            print(f"    {human_bytes(block['bytes']):>10}  {block['where']}")
    print(format_table(["kernel (ours - plain)", "ms per step", "calls", "plain's"],
                       [[k["name"], f"{k['extra_ms']:+.2f}", k.get("calls", "?"), k.get("plain_calls", "?")]
                        for k in vs["kernels_more"] + vs["kernels_less"]]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
