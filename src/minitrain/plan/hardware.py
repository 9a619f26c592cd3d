"""The machines a plan is made for: each one's memory, peak FLOP/s by precision, and an alpha-beta link per
collective within a node and across nodes. Three GPU presets from their datasheets, or this machine measured
(cpu-here: a matmul timed now, the links fitted by `minitrain bench comm`)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError

GB = 1e9


@dataclass
class Link:
    alpha_s: float  # latency of one collective
    beta_Bps: float  # bus bandwidth


@dataclass
class Hardware:
    name: str
    memory_bytes: float
    peak_flops: dict[str, float]  # by precision, dense
    intra: dict[str, Link]  # by op: all_reduce, all_gather, reduce_scatter (and others from bench comm)
    inter: dict[str, Link]
    gpus_per_node: int = 8
    source: str = ""
    # What the optimizer's chunk size is chosen for (train/optim.py), and whose autocast the loss's terms follow.
    device: str = "cuda"


def _links(alpha_s: float, beta_Bps: float) -> dict[str, Link]:
    return {op: Link(alpha_s, beta_Bps) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")}


# Datasheet peaks (dense); bus bandwidths are what NCCL's tests reach in practice, below the links' nominal rates.
PRESETS = {
    "a100-80g": Hardware("a100-80g", 80 * 2**30, {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12},
                         _links(15e-6, 230 * GB), _links(30e-6, 22 * GB),
                         source="A100 SXM 80GB datasheet; NVLink 3, HDR InfiniBand"),
    # ZeRO-Offload's machine (Ren et al. 2021): no bf16 units, so bf16 gets the fp32 rate at best.
    "v100-32g": Hardware("v100-32g", 32 * 2**30, {"fp32": 15.7e12, "bf16": 15.7e12, "fp16": 125e12},
                         _links(15e-6, 130 * GB), _links(30e-6, 11 * GB),
                         source="V100 SXM2 32GB datasheet; NVLink 2, EDR InfiniBand"),
    "h100-sxm": Hardware("h100-sxm", 80 * 2**30, {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12},
                         _links(15e-6, 360 * GB), _links(30e-6, 45 * GB),
                         source="H100 SXM5 datasheet; NVLink 4, NDR InfiniBand"),
}


def cpu_here(comm_json: str | Path) -> Hardware:
    """This machine: memory from /proc/meminfo, peak FLOP/s from a one-thread float32 matmul
    measured now, alpha and beta per op from `minitrain bench comm`'s comm.json."""
    path = Path(comm_json)
    try:
        ops = json.loads(path.read_text())["ops"]
    except FileNotFoundError:
        raise ConfigError(f"--hardware cpu-here needs {path}: run `minitrain bench comm --out {path.parent}` "
                          "first (or pass --comm-json)") from None
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot read {path} as `minitrain bench comm` output: {e}") from None
    links = {op: Link(r["alpha_s"], r["beta_Bps"]) for op, r in ops.items()}
    links.setdefault("send", links.get("broadcast", links["all_reduce"]))
    links.setdefault("all_to_all", links["all_gather"])  # a comm.json from before bench comm measured it
    memory = 0.0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            memory = int(line.split()[1]) * 1024
    flops = measure_matmul_flops()
    return Hardware("cpu-here", memory, {"fp32": flops, "bf16": flops, "fp16": flops}, links, links,
                    gpus_per_node=1 << 30, source=f"measured: matmul now, collectives from {path}", device="cpu")


def measure_matmul_flops(n: int = 512, seconds: float = 0.3) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per rank, as minitrain runs
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        return 2 * n**3 * count / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
