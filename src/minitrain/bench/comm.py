"""`minitrain bench comm`: what each collective costs on this machine, and a latency-bandwidth
(alpha-beta) model fitted to it.

For all_reduce, all_gather, reduce_scatter, broadcast and all_to_all, at sizes S from 1 KiB to
--max-mb MiB (x4 apart), every rank times each call between barriers; a call's time is the
slowest rank's, and the figure is the median over iterations after warmup. Bandwidths follow
nccl-tests (doc/PERFORMANCE.md): S is the full buffer (the all-reduced tensor, the gathered
output, the reduce-scatter input, the broadcast tensor, the all-to-all input), algbw = S / t,
busbw = algbw x factor, with factor 2(N-1)/N for all_reduce, (N-1)/N for all_gather,
reduce_scatter and all_to_all, and 1 for broadcast: busbw is what each link carried, comparable
across ops and world sizes.

Fit, per op: t = alpha + factor x S / beta, least squares on relative error (weights 1/t^2, so
1 KiB and 64 MiB count alike): alpha is the latency in seconds, beta the bus bandwidth in
bytes/s. The planner reads alpha and beta from comm.json.

Writes under --out: comm.json (every measurement and the fit) and comm.png (busbw against size
per op, measured and fitted).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import pyplot, save_figure
from ..config import ConfigError
from ..runtime.launch import launch
from ..train.metrics import format_table, human_bytes
from ..runtime.topology import Topology

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
MIN_BYTES = 1024
ELEMENT = 4  # float32


@dataclass
class CommOptions:
    nproc: int = 2
    max_mb: float = 64.0
    out: str = "runs/bench-comm"
    ops: tuple[str, ...] = OPS
    budget_s: float = 0.3  # per (op, size): iterate about this long (3 to 50 iterations)


def bus_factor(op: str, world: int) -> float:
    if op == "all_reduce":
        return 2 * (world - 1) / world
    return 1.0 if op == "broadcast" else (world - 1) / world


def sizes(max_mb: float) -> list[int]:
    """1 KiB, 4 KiB, ... up to max_mb MiB (the worker rounds each down to a multiple of N floats)."""
    out, size = [], MIN_BYTES
    while size <= max_mb * 2**20:
        out.append(size)
        size *= 4
    return out


def _call(comm, op: str, full: torch.Tensor, part: torch.Tensor, spare: torch.Tensor):
    """The collective as a no-argument call on preallocated buffers (nothing allocated while timed)."""
    return {"all_reduce": lambda: comm.all_reduce_sum(full),
            "all_gather": lambda: comm.all_gather(full, part),
            "reduce_scatter": lambda: comm.reduce_scatter_sum(part, full),
            "broadcast": lambda: comm.broadcast(full, src=0),
            "all_to_all": lambda: comm.all_to_all(spare, full)}[op]


def time_call(comm, call, budget_s: float, sync) -> float:
    """Median over iterations of the slowest rank's time: 3 warmup calls, then 3 to 50 timed ones,
    stopping once about budget_s is spent. Every rank sees the same gathered times, so all stop
    at the same iteration."""
    times: list[float] = []
    for i in range(53):
        comm.barrier()
        start = time.perf_counter()
        call()
        sync()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        slowest = comm.gather_rows(elapsed)[:, 0].max().item()
        if i >= 3:
            times.append(slowest)
            if len(times) >= 3 and sum(times) >= budget_s:
                break
    return statistics.median(times)


def comm_worker(topo: Topology, opts: CommOptions) -> dict:
    comm, world = topo.dp, topo.world_size
    sync = (lambda: torch.cuda.synchronize(topo.device)) if topo.device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {op: [] for op in opts.ops}
    measured = []
    for size in sizes(opts.max_mb):
        n = size // ELEMENT // world * world  # divisible into world equal parts
        full, part, spare = (torch.ones(m, device=topo.device) for m in (n, n // world, n))
        measured.append(n * ELEMENT)
        for op in opts.ops:
            times[op].append(time_call(comm, _call(comm, op, full, part, spare), opts.budget_s, sync))
    return {"world_size": world, "backend": topo.backend, "sizes_bytes": measured, "times": times}


def fit_alpha_beta(sizes_b: list[int], times_s: list[float], factor: float) -> tuple[float, float]:
    """t = alpha + factor*S/beta, least squares on relative error; returns (alpha s, beta B/s)."""
    t = np.asarray(times_s, dtype=np.float64)
    x = factor * np.asarray(sizes_b, dtype=np.float64)
    a = np.stack([1 / t, x / t], axis=1)  # (alpha + x*inv_beta) / t ~ 1
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return float(alpha), float(1 / inv_beta) if inv_beta > 0 else float("inf")


def report(raw: dict) -> dict:
    world, sz, ops = raw["world_size"], raw["sizes_bytes"], {}
    for op, times in raw["times"].items():
        factor = bus_factor(op, world)
        algbw = [s / t for s, t in zip(sz, times)]
        alpha, beta = fit_alpha_beta(sz, times, factor)
        ops[op] = {"busbw_factor": factor, "sizes_bytes": sz, "time_s": times, "algbw_Bps": algbw,
                   "busbw_Bps": [b * factor for b in algbw], "alpha_s": alpha, "beta_Bps": beta,
                   "fit_time_s": [alpha + factor * s / beta for s in sz]}
    return {"world_size": world, "dtype": "float32", "backend": raw["backend"], "ops": ops,
            "definitions": "algbw = S/t; busbw = algbw * factor (nccl-tests); fit t = alpha + factor*S/beta"}


def plot(rep: dict, path: Path) -> None:
    fig, ax = pyplot("bench comm").subplots(figsize=(6, 4), dpi=120)
    for op, r in rep["ops"].items():
        line, = ax.plot(r["sizes_bytes"], [b / 1e9 for b in r["busbw_Bps"]], "o-", label=op)
        fitted = [r["busbw_factor"] * s / t / 1e9 for s, t in zip(r["sizes_bytes"], r["fit_time_s"])]
        ax.plot(r["sizes_bytes"], fitted, "--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size S (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"Collectives, {rep['world_size']} ranks ({rep['backend']}); dashed: alpha-beta fit")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def check_comm_options(opts: CommOptions) -> None:
    """ConfigError (exit 2, one line) before anything runs or is written."""
    pyplot("bench comm (comm.png)")
    if opts.nproc < 2:
        raise ConfigError(f"bench comm needs at least 2 ranks to communicate (got --nproc {opts.nproc})")
    if opts.max_mb * 2**20 < MIN_BYTES:
        raise ConfigError(f"--max-mb {opts.max_mb:g} is below the smallest size, 1 KiB")


def run_comm(opts: CommOptions) -> int:
    check_comm_options(opts)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"bench comm: {len(opts.ops)} ops x {len(sizes(opts.max_mb))} sizes on {opts.nproc} ranks ...", flush=True)
    rep = report(launch(comm_worker, opts.nproc, opts, backend="auto")[0])
    (out / "comm.json").write_text(json.dumps(rep, indent=1))
    plot(rep, out / "comm.png")
    rows = []
    for op, r in rep["ops"].items():
        for s, t, a, b in zip(r["sizes_bytes"], r["time_s"], r["algbw_Bps"], r["busbw_Bps"]):
            rows.append([op, human_bytes(s), f"{1e6 * t:.1f}", f"{a / 1e9:.3f}", f"{b / 1e9:.3f}"])
    print(format_table(["op", "size", "time us", "algbw GB/s", "busbw GB/s"], rows, "<>>>>"))
    fits = [[op, f"{1e6 * r['alpha_s']:.1f}", f"{r['beta_Bps'] / 1e9:.3f}"] for op, r in rep["ops"].items()]
    print("\nalpha-beta fit, t = alpha + factor*S/beta:")
    print(format_table(["op", "alpha us", "beta GB/s"], fits, "<>>"))
    print(f"wrote {out / 'comm.json'} and {out / 'comm.png'}")
    return 0
