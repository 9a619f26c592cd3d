"""Where a step's peak memory is: the resident high-water mark between hooks of the forward and backward, ours
against PyTorch's wrappers, on benchmarks/prepare_vs_peers.py's model and loop (a diagnosis, not a table).

Rank 0 of 2 ranks, one configuration per launch. The peak RSS (VmHWM, reset at every mark) above what the
process held before the model was built is read at each block's forward pre-hook, each block's backward pre-
and post-hook, the embedding's backward, and between the loop's calls; so each line is the most memory held
since the line before it, and the last figure the memory held at the mark.

    .venv/bin/python benchmarks/memory_by_phase.py [--steps 3] zero3 fsdp2 [zero2 fsdp2-zero2 ...]
"""
from __future__ import annotations

import argparse
import gc
import os

from prepare_vs_peers import BATCH, CONFIGS, GPT2, SEQ, _build  # benchmarks/prepare_vs_peers.py

from minitrain.runtime.launch import launch
from minitrain.train.memory import DevicePeak


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(topo, name: str, steps: int) -> list[tuple[str, float, float]]:
    import torch
    import torch.distributed.fsdp  # noqa: F401  every peer's modules loaded before the baseline
    import torch.distributed.optim  # noqa: F401
    import torch.nn.functional as F
    import transformers  # noqa: F401

    import minitrain

    peak = DevicePeak(topo.device)
    gc.collect()
    peak.reset()
    baseline = peak.bytes()
    model, opt, clip_params = _build(name, topo)
    marks: list[tuple[str, float, float]] = []

    def mark(label: str) -> None:
        marks.append((label, (peak.bytes() - baseline) / 2**20, (resident_bytes() - baseline) / 2**20))
        peak.reset()

    inner = model.module if hasattr(model, "module") else model  # under DistributedDataParallel
    for i, block in enumerate(inner.transformer.h):
        block.register_forward_pre_hook(lambda _m, _a, i=i: mark(f"forward to block {i}"))
        block.register_full_backward_pre_hook(lambda _m, _g, i=i: mark(f"backward to block {i}"))
        block.register_full_backward_hook(lambda _m, _gi, _go, i=i: mark(f"block {i}'s backward"))
    inner.transformer.wte.register_full_backward_pre_hook(lambda _m, _g: mark("backward to the embedding"))
    g = torch.Generator().manual_seed(1 + topo.rank)
    for _ in range(steps):
        marks.clear()
        x = torch.randint(0, GPT2["vocab_size"], (BATCH, SEQ), generator=g)
        mark("step start")
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        del logits
        mark("rest of the forward and the loss")
        loss.backward()
        mark("the embedding's backward")
        if clip_params is None:
            minitrain.clip_grad_norm_(model, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(clip_params, 1.0)
        mark("clip")
        opt.step()
        mark("optimizer step")
        opt.zero_grad()
        mark("zero_grad")
    peak.close()
    return marks  # the last step's


def print_marks(name: str, marks: list[tuple[str, float, float]]) -> None:
    print(f"{name}: peak MiB since the line before / held at the mark (rank 0, above the pre-model baseline)")
    for label, peak_mib, held_mib in marks:
        print(f"  {label:34s} {peak_mib:7.1f} {held_mib:7.1f}")
    print(f"  {'the step':34s} {max(p for _, p, _ in marks):7.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", choices=CONFIGS)
    parser.add_argument("--steps", type=int, default=3, help="steps run; the last one is shown")
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # inherited by the ranks: RSS follows tensors
    for name in args.configs:
        print_marks(name, launch(worker, 2, name, args.steps, backend="gloo", timeout_s=600)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
