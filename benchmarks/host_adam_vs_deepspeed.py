"""The host's AdamW step of an offloaded optimizer, minitrain's against DeepSpeed's ZeRO-Offload CPU Adam.

With `--train.offload cpu` the optimizer steps where its state is, on the host: on a GPU machine that step is most
of an offloaded step's time (docs/zero.md: 78 ms of gpt2-124m's on an H100's host, 16 threads). DeepSpeed's
ZeRO-Offload steps there with a kernel of its own (`DeepSpeedCPUAdam`, C++ with SIMD intrinsics and OpenMP); ours
is `FlatAdamW`, PyTorch's fused CPU AdamW in chunks of `--train.offload_chunk_mb` (4 MiB: 1M float32 elements), in
two forms: as a CPU-only machine runs it, the weight decay a pass before each chunk (torch.optim.AdamW's default
update, to the bit), and as it runs offloaded from a GPU, the decay applied by the kernel (torch.optim.AdamW(fused=
True)'s update). This times the three on the same host, over one float32 vector of a preset's parameter count
(master, m and v float32: ZeRO-Offload's layout), weight decay on all of it, the gradient float32 as ZeRO-Offload
hands it to its kernel, in turns within each repeat, each ratio to DeepSpeed's formed within a repeat. It also
steps each 3 times from the same state and gradient and reports how far each lands from torch.optim.AdamW in
float64 (in ulps of the float32 result).

It measures the host's half of ZeRO-Offload only: the copies across a GPU's bus and their overlap with this step
are measured on a GPU (benchmarks/gpu.py's offload rows).

Needs DeepSpeed (`pip install deepspeed`; its CPU Adam is compiled on first use, about 2 minutes here). Both
kernels get N threads: torch's pool for ours, OpenMP's for DeepSpeed's, which reads OMP_NUM_THREADS once, when
its library loads, so the variable must say N from the start:

    OMP_NUM_THREADS=N .venv/bin/python benchmarks/host_adam_vs_deepspeed.py --threads N [--preset gpt2-124m]
        [--steps 5] [--repeats 3] [--out FILE]

Writes benchmarks/results/host_adam_vs_deepspeed_tN.json (or --out) and prints the table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

from minitrain import plan
from minitrain.train.metrics import format_table
from minitrain.train.optim import FlatAdamW
from minitrain.train.run_config import run_config

LR, BETAS, EPS, DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.1
CHUNK = (4 << 20) // 4  # --train.offload_chunk_mb's default, in float32 elements


class Ours:
    """FlatAdamW as a CPU-only machine runs it: the weight decay a pass of its own before each chunk's kernel (so
    that it is torch.optim.AdamW's default update to the bit)."""
    fold = False

    def __init__(self, master: torch.Tensor):
        self.opt = FlatAdamW(master, [(0, master.numel())], betas=BETAS, eps=EPS, weight_decay=DECAY, chunk=CHUNK,
                             fold_decay=self.fold)
        self.master = self.opt.master

    def step(self, grad: torch.Tensor) -> None:
        self.opt.step(grad, LR)  # unclipped (scale 1): the gradient is read, not scaled in place


class OursFolded(Ours):
    """FlatAdamW as it runs offloaded from a GPU: the decay applied by the fused kernel (torch.optim.AdamW(fused=True)'s
    update), one pass over the master fewer."""
    fold = True


class DeepSpeeds:
    def __init__(self, master: torch.Tensor):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        self.master = torch.nn.Parameter(master)
        self.opt = DeepSpeedCPUAdam([self.master], lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, adamw_mode=True)

    def step(self, grad: torch.Tensor) -> None:
        self.master.grad = grad
        self.opt.step()


def step_ms(make, master: torch.Tensor, grad: torch.Tensor, steps: int) -> float:
    opt = make(master.clone())
    opt.step(grad)  # warm-up: first-touch of m and v
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        opt.step(grad)
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def ulps_from_float64(n: int) -> dict:
    """Both kernels' first step from one state and gradient, against torch.optim.AdamW in float64: the largest
    difference, in units of the float32 result's last place."""
    g = torch.Generator().manual_seed(0)
    master, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    exact = torch.nn.Parameter(master.double())
    ref = torch.optim.AdamW([exact], lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, foreach=False)
    for _ in range(3):
        exact.grad = grad.double()
        ref.step()
    found = {}
    for name, make in KINDS.items():
        opt = make(master.clone())
        for _ in range(3):
            opt.step(grad.clone())
        got = opt.master.detach().double()
        ulp = torch.abs(torch.nextafter(got.float(), torch.full_like(got.float(), float("inf"))).double() - got)
        found[name] = float(((got - exact.detach()).abs() / ulp).max())
    return found


KINDS = {"minitrain": Ours, "minitrain, decay folded": OursFolded, "deepspeed": DeepSpeeds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--threads", type=int, required=True, help="threads for both kernels (= OMP_NUM_THREADS)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="default: benchmarks/results/host_adam_vs_deepspeed_tTHREADS.json")
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") != str(args.threads):
        print(f"benchmarks/host_adam_vs_deepspeed.py: error: run it as OMP_NUM_THREADS={args.threads} ... "
              "(DeepSpeed's kernel reads the variable once, when it loads)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed looks for Intel's extension for PyTorch
    try:
        import deepspeed
    except ImportError:
        print("benchmarks/host_adam_vs_deepspeed.py: error: needs DeepSpeed (pip install deepspeed)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    n = plan.model_params(run_config(cli_values={"model.preset": args.preset}).model)
    master, grad = torch.randn(n), torch.randn(n) * 1e-2
    times = {name: [] for name in KINDS}
    ratios = {name: [] for name in KINDS if name != "deepspeed"}
    for repeat in range(args.repeats):
        order = list(KINDS) if repeat % 2 == 0 else list(reversed(KINDS))
        measured = {name: step_ms(KINDS[name], master, grad, args.steps) for name in order}
        for name, ms in measured.items():
            times[name].append(ms)
        for name in ratios:
            ratios[name].append(measured[name] / measured["deepspeed"])
        print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in measured.items()))
    ulps = ulps_from_float64(1 << 16)
    rows = [{"preset": args.preset, "params": n, "threads": args.threads, "optimizer": name,
             "step_ms": statistics.median(times[name]),
             "vs_deepspeed": median_range(ratios[name]) if name in ratios else None, "ulps": ulps[name]}
            for name in KINDS]
    print(format_table(["preset", "params", "threads", "optimizer", "step ms", "vs DeepSpeed", "ulps from float64"],
                       [[r["preset"], f"{n:,}", args.threads, r["optimizer"], f"{r['step_ms']:.1f}",
                         "" if r["vs_deepspeed"] is None else fmt_range(r["vs_deepspeed"], "{:.2f}"),
                         f"{r['ulps']:.1f}"] for r in rows]))
    out = write_result(args.out or RESULTS / f"host_adam_vs_deepspeed_t{args.threads}.json", __file__, argv,
                       {"steps": args.steps, "repeats": args.repeats, "rows": rows}, deepspeed=deepspeed.__version__)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
