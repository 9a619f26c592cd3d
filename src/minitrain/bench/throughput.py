"""`minitrain bench throughput`: one process, minitrain's trainer against the best plain PyTorch loop.

The peer is a nanoGPT-style loop around the same MiniGPT (same initial weights, same data, same
schedule and clipping): torch.optim.AdamW with its fused kernel (multi-tensor where the device has
none), `clip_grad_norm_` (multi-tensor), autocast for bf16/fp16 with float32 parameters (PyTorch's
own mixed-precision recipe), gradients set to None between steps, batches copied from pinned
memory without blocking on a GPU. Both use the fused attention kernel and, with --compile, compile
each block the same way. The two alternate in rounds of `--steps` steps (after `--warmup` each),
so drift on a shared machine hits both alike; figures are medians over rounds.

MFU (model FLOPs utilisation, Chowdhery et al., PaLM, appendix B): training FLOPs per token
6N + 12 L h T (N parameters, L layers, h width, T context), times tokens/s, over the device's peak:
NVIDIA's dense bf16 tensor-core figure for A100/H100/H200, and elsewhere (the CPU) the peak of one
large matrix multiply in the run's dtype, measured on the spot with the threads the run uses.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import PRESETS, ConfigError, RunConfig
from ..train.run_config import run_config
from ..data import make_loader
from ..utils.prefetch import to_device
from ..train.metrics import format_table
from ..models.minigpt.plan import MINIGPT_PLAN
from ..models.minigpt.model import MiniGPT
from ..train.optim import FUSED_DEVICES, lr_at
from ..parallel.compiled import compile_blocks
from .peers import decay_groups
from ..plan import PlanInput, flops_per_token
from ..train.precision import autocast, compute_dtype
from ..runtime.topology import Topology
from ..train.trainer import Trainer

# Dense (no sparsity) bf16 tensor-core peaks, SXM parts, from NVIDIA's data sheets.
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}
PRECISIONS = ("fp32", "bf16")


@dataclass
class ThroughputOptions:
    out: str = "runs/bench-throughput"
    preset: str = "small"
    precisions: list[str] = field(default_factory=lambda: ["fp32"])
    compile: bool = False
    batch_size: int = 8
    steps: int = 5  # measured steps per side and round
    rounds: int = 3
    warmup: int = 2
    late_stats: str = "auto"  # ours: --train.late_stats (auto: on a GPU, statistics read while the next step runs)


def check_throughput_options(opts: ThroughputOptions) -> None:
    if opts.preset not in PRESETS:
        raise ConfigError(f"unknown preset '{opts.preset}'; choose one of: {', '.join(PRESETS)}")
    for precision in opts.precisions:
        if precision not in PRECISIONS:
            raise ConfigError(f"--precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    for name in ("batch_size", "steps", "rounds"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(opts, name)}")
    if opts.warmup < 0:
        raise ConfigError(f"--warmup must be at least 0, got {opts.warmup}")


def bench_config(opts: ThroughputOptions, precision: str) -> RunConfig:
    steps = opts.warmup + opts.steps * opts.rounds
    return run_config(cli_values={
        "model.preset": opts.preset, "train.precision": precision, "train.compile": opts.compile,
        "train.batch_size": opts.batch_size, "train.steps": steps, "train.warmup_steps": 1, "train.log_every": 0,
        "train.late_stats": opts.late_stats,
        "data.synthetic_tokens": max(65536, 4 * opts.batch_size * (PRESETS[opts.preset]["seq_len"] + 1)),
    })


class PlainLoop:
    """The peer: the loop a PyTorch user writes (see the module docstring)."""

    def __init__(self, cfg: RunConfig, device: torch.device):
        t = cfg.train
        self.cfg, self.device, self.step = cfg, device, 0
        torch.manual_seed(t.seed)  # the trainer's initial weights
        self.model = MiniGPT(cfg.model).to(device)
        if t.compile:
            compile_blocks(self.model, MINIGPT_PLAN)  # as the trainer does
        groups = decay_groups(self.model, t.weight_decay)
        kernel = {"fused": True} if device.type in FUSED_DEVICES else {"foreach": True}
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **kernel)
        # The trainer's data path, as a plain loop with a DataLoader's pinned workers would have it.
        self.loader = make_loader(cfg, 0, 1, prefetch=cfg.data.prefetch, pin_memory=device.type == "cuda")

    def train_step(self) -> torch.Tensor:
        t, device = self.cfg.train, self.device
        x, y = to_device(self.loader.next_batch(), device)
        with autocast(t, device):
            loss = self.model(x, y)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip, foreach=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, t)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss.detach()


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for model, peak in PEAK_BF16_FLOPS.items():
            if model in name and dtype == torch.bfloat16:
                return peak, f"{model} dense bf16 data sheet"
    # Elsewhere the best a matrix multiply reaches here, in float32 or the compute dtype (a CPU without
    # native bf16 runs autocast's bf16 work at its float32 rate or below, never above).
    n = 4096 if device.type == "cuda" else 512
    flops, best = max((measured_matmul_flops(device, d, n), d) for d in {torch.float32, dtype})
    return flops, f"measured: the fastest {str(best).removeprefix('torch.')} {n}x{n} matrix multiply of up to 6"


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of the fastest of up to 6 n x n multiplies (fewer once a second has passed: a CPU without
    native bf16 multiplies at a hundredth of its float32 rate)."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    a @ b  # warm-up
    best, began = 0.0, time.perf_counter()
    for _ in range(6):
        _synchronize(device)
        start = time.perf_counter()
        a @ b
        _synchronize(device)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - start))
        if time.perf_counter() - began > 1.0:
            break
    return best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(step, steps: int, device: torch.device) -> float:
    """Seconds for `steps` calls of step(), waiting for the device at the end only."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize(device)
    return time.perf_counter() - start


def measure(opts: ThroughputOptions, precision: str, device: torch.device) -> dict:
    cfg = bench_config(opts, precision)
    # As `minitrain train` makes it: the parameter norm on the steps that print a progress line (none here) and
    # the last.
    ours = Trainer(cfg, Topology.single(device), param_norm_every=cfg.train.log_every)
    plain = PlainLoop(cfg, device)
    for _ in range(opts.warmup):  # compiles, allocates, warms caches
        ours.launch_step()
        plain.train_step()
    tokens = opts.steps * opts.batch_size * cfg.model.seq_len
    rounds = []
    for r in range(opts.rounds):
        # Ours steps as the run loop does (launch_step: with late statistics the step before's are read meanwhile).
        sides = [("ours", ours.launch_step), ("plain", plain.train_step)]
        timed = {name: _timed_steps(step, opts.steps, device) for name, step in (sides if r % 2 == 0 else sides[::-1])}
        rounds.append({name: tokens / seconds for name, seconds in timed.items()})
    ours.settle()
    ours.close()
    ours_tps = statistics.median(r["ours"] for r in rounds)
    plain_tps = statistics.median(r["plain"] for r in rounds)
    per_token, _ = flops_per_token(PlanInput(model=cfg.model, params=ours.model.num_params()))
    peak, source = peak_flops(device, compute_dtype(cfg.train))
    return {"preset": opts.preset, "precision": precision, "compile": opts.compile, "batch_size": opts.batch_size,
            "late_stats": ours.late_stats,
            "seq_len": cfg.model.seq_len, "params": ours.model.num_params(), "tokens_per_s": ours_tps,
            "plain_tokens_per_s": plain_tps, "ratio": statistics.median(r["ours"] / r["plain"] for r in rounds),
            "step_ms": 1000 * opts.batch_size * cfg.model.seq_len / ours_tps,
            "plain_step_ms": 1000 * opts.batch_size * cfg.model.seq_len / plain_tps,
            "flops_per_token": per_token, "peak_flops": peak, "peak_source": source,
            "mfu": ours_tps * per_token / peak, "plain_mfu": plain_tps * per_token / peak, "rounds": rounds}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} thread(s)"


def run_throughput(opts: ThroughputOptions) -> int:
    check_throughput_options(opts)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = []
    for precision in opts.precisions:
        configs.append(measure(opts, precision, device))
        c = configs[-1]
        print(f"{precision}{' compiled' if opts.compile else ''}: minitrain {c['tokens_per_s']:,.0f} tok/s, plain "
              f"{c['plain_tokens_per_s']:,.0f} tok/s, ratio {c['ratio']:.3f}, MFU {c['mfu']:.1%}", flush=True)
    report = {"device": device_name(device), "torch": torch.__version__, "options": asdict(opts), "configs": configs}
    (out / "throughput.json").write_text(json.dumps(report, indent=1))
    rows = [[c["precision"], "yes" if c["compile"] else "no", f"{c['tokens_per_s']:,.0f}",
             f"{c['plain_tokens_per_s']:,.0f}", f"{c['ratio']:.3f}", f"{c['step_ms']:.1f}", f"{c['plain_step_ms']:.1f}",
             f"{c['mfu']:.1%}", f"{c['plain_mfu']:.1%}"] for c in configs]
    print(f"\n{report['device']}, preset {opts.preset}, batch {opts.batch_size}, median of {opts.rounds} rounds "
          f"of {opts.steps} steps")
    print(format_table(["precision", "compile", "ours tok/s", "plain tok/s", "ours/plain", "ours ms", "plain ms",
                        "MFU", "plain MFU"], rows))
    print(f"peak {configs[0]['peak_flops'] / 1e12:.2f} TFLOP/s ({configs[0]['peak_source']}); wrote "
          f"{out / 'throughput.json'}")
    return 0
