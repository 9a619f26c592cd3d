"""The figures only a GPU gives, in one process group on one CUDA device (gpt2-124m, bf16):

- memory: `minitrain plan`'s predicted peak per rank against `torch.cuda.max_memory_allocated` over a step (after
  a warm-up step), at ZeRO 0 and 3, without and with block activation checkpointing;
- timings on NCCL (world 1, a real process group whose collectives are issued, not skipped): the step time, the collectives' time from device events, the
  overlap of the gradient sync with backward, the busy time, and how much of the step the timed phases cover;
- offload: the step time with the optimizer's master and state in host memory (`--train.offload cpu`) as a ratio
  to the state on the device, at ZeRO 0 and 2;
- where a step's device time goes: the top kernels of one step under torch.profiler;
- against the plain PyTorch loop of `minitrain bench throughput` (batch 16): the device's busy time per step
  (kernels) beside the wall time, and the kernels where the two differ most: what the gap between them is made of.

Throughput and MFU against a plain loop are `minitrain bench throughput` (its own results file).

    python benchmarks/gpu.py [--batch 8] [--steps 5] [--out FILE]

Writes benchmarks/results/gpu.json (or --out). Needs a CUDA device; exits 2 without one.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.runtime.launch import launch
from minitrain.train import estimate as plan
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
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"name": e.key[:90], "calls": e.count, "device_ms": e.self_device_time_total / 1000,
             "share": e.self_device_time_total / total if total else 0.0} for e in events[:count]]


def _kernel_times(step, steps: int = 3) -> tuple[float, float, dict[str, float]]:
    """(wall seconds per step, device-busy seconds per step, seconds per step by kernel name) over `steps`."""
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
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e6 / steps
    return wall, sum(by_name.values()), by_name


def against_plain(topo, batch: int = 16) -> dict:
    from minitrain.bench.throughput import PlainLoop, ThroughputOptions, bench_config

    cfg = bench_config(ThroughputOptions(preset=PRESET, precisions=["bf16"], batch_size=batch), "bf16")
    with Trainer(cfg, topo.single(topo.device)) as trainer:
        ours = _kernel_times(trainer.train_step)
    plain = _kernel_times(PlainLoop(cfg, topo.device).train_step)
    names = set(ours[2]) | set(plain[2])
    diff = sorted(((ours[2].get(n, 0.0) - plain[2].get(n, 0.0), n) for n in names), reverse=True)
    return {"batch": batch, "ours": {"wall_s": ours[0], "busy_s": ours[1]}, "plain": {"wall_s": plain[0],
            "busy_s": plain[1]}, "kernels_more": [{"name": n[:90], "extra_ms": 1000 * d} for d, n in diff[:12]],
            "kernels_less": [{"name": n[:90], "extra_ms": 1000 * d} for d, n in diff[-5:]]}


def _measure(topo, batch: int, steps: int) -> dict:
    topo = topo.issuing_alone()  # every collective through NCCL, as at world > 1, so that its costs show
    return {"device": torch.cuda.get_device_name(), "cuda": torch.version.cuda, "nccl": ".".join(
        map(str, torch.cuda.nccl.version())), "backend": topo.backend, "memory": memory_rows(topo, batch),
            "timings": timing_rows(topo, batch, steps), "top_kernels": top_kernels(topo, batch),
            "against_plain": against_plain(topo)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="examples per step (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per timing row (default 5)")
    parser.add_argument("--out", default=str(RESULTS / "gpu.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: error: no CUDA device here", file=sys.stderr)
        sys.exit(2)
    [body] = launch(_measure, 1, args.batch, args.steps, backend="nccl", threads_per_rank=16, timeout_s=900)
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
    print(f"against the plain loop, batch {vs['batch']}: step {1000 * vs['ours']['wall_s']:.1f} vs "
          f"{1000 * vs['plain']['wall_s']:.1f} ms wall, device busy {1000 * vs['ours']['busy_s']:.1f} vs "
          f"{1000 * vs['plain']['busy_s']:.1f} ms")
    print(format_table(["kernel (ours - plain)", "ms per step"],
                       [[k["name"], f"{k['extra_ms']:+.2f}"] for k in vs["kernels_more"] + vs["kernels_less"]]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
