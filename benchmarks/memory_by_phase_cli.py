"""Where a step's peak memory is in the CLI's trainer, ours against PyTorch's wrappers (benchmarks/zero_stages.py's
models and configurations; a diagnosis, not a table). benchmarks/memory_by_phase.py does the same for the API.

Rank 0 of --world ranks, one configuration per launch. The peak RSS (VmHWM, reset at every mark) above what the
process held before the model was built is read at each block's forward pre-hook, before the head's forward, at
the backward pre-hook of the head, of each block and of the token embedding, when the tied embedding weight's
gradient has been summed over its two uses (before it is accumulated into .grad, and so before any strategy's hook
sees it), and after the step. Each line is the most memory held since the line before it, and the memory held at
the mark.

    .venv/bin/python benchmarks/memory_by_phase_cli.py [--model gpt2-124m] [--world 2] [--steps 3] zero2 fsdp2-zero2
"""
from __future__ import annotations

import argparse
import gc
import os

from memory_by_phase import print_marks, resident_bytes  # benchmarks/memory_by_phase.py
from zero_stages import CONFIGS, MODELS, PEER_OF  # benchmarks/zero_stages.py

from minitrain.bench.peers import PeerTrainer
from minitrain.runtime.launch import launch
from minitrain.train.memory import DevicePeak
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer


def worker(topo, name: str, steps: int, model: dict) -> list[tuple[str, float, float]]:
    import torch.distributed.fsdp  # noqa: F401  every peer's modules loaded before the baseline
    import torch.distributed.optim  # noqa: F401

    stage = int(name[-1]) if name in PEER_OF else 0
    cfg = run_config(cli_values={**model, "train.zero": stage, "train.steps": steps, "dist.nproc": topo.world_size,
                                 "train.log_every": 0})
    peak = DevicePeak(topo.device)
    gc.collect()
    peak.reset()
    baseline = peak.bytes()
    trainer = Trainer(cfg, topo) if name in PEER_OF else PeerTrainer(cfg, topo, name)
    marks: list[tuple[str, float, float]] = []

    def mark(label: str) -> None:
        marks.append((label, (peak.bytes() - baseline) / 2**20, (resident_bytes() - baseline) / 2**20))
        peak.reset()

    gpt = trainer.model
    for i, block in enumerate(gpt.blocks.values()):
        block.register_forward_pre_hook(lambda _m, _a, i=i: mark(f"forward to block {i}"))
        block.register_full_backward_pre_hook(lambda _m, _g, i=i: mark(f"backward to block {i}"))
    gpt.head.register_forward_pre_hook(lambda _m, _a: mark("forward to the head"))
    gpt.head.register_full_backward_pre_hook(lambda _m, _g: mark("backward to the head"))
    gpt.tok_emb.register_full_backward_pre_hook(lambda _m, _g: mark("backward to the embedding"))
    if gpt.head.weight is gpt.tok_emb.weight:  # FSDP2's parameter is another object than the model's attribute
        # The node that accumulates the weight's gradient: its pre-hook sees the sum of both uses' gradients.
        accumulate = gpt.tok_emb.weight.view_as(gpt.tok_emb.weight).grad_fn.next_functions[0][0]
        accumulate.register_prehook(lambda _grads: mark("tied weight's gradient summed"))
    for _ in range(steps):
        marks.clear()
        mark("step start")
        trainer.train_step()
        mark("rest of the step")
    peak.close()
    return marks  # the last step's


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", choices=CONFIGS)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2-124m")
    parser.add_argument("--world", type=int, default=2, help="ranks (rank 0 is shown)")
    parser.add_argument("--steps", type=int, default=3, help="steps run; the last one is shown")
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # inherited by the ranks: RSS follows tensors
    for name in args.configs:
        print_marks(name, launch(worker, args.world, name, args.steps, MODELS[args.model], backend="gloo",
                                 timeout_s=900)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
