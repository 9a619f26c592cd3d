"""`minitrain.prepare` on a Hugging Face GPT-2 (~10M parameters) against PyTorch's own wrappers of the same model.

Each ZeRO stage of ours is measured beside the PyTorch-native way of sharding the same things:
  zero0 vs DistributedDataParallel + AdamW          (nothing sharded)
  zero1 vs DDP + ZeroRedundancyOptimizer(AdamW)      (optimizer state sharded)
  zero2 vs FSDP2 fully_shard(reshard_after_forward=False), per block and root
  zero3 vs FSDP2 fully_shard, per block and root     (parameters sharded too)
Same model and initial weights, same data, the user's loop (forward, loss, backward, clip_grad_norm_ to 1.0,
AdamW step, zero_grad), gloo on CPU, one thread per rank. Each repeat runs every configuration back to back
(rotated order) in freshly launched ranks and takes the median step time after warmup; ratios are formed within
a repeat and reported as median [min-max] over repeats. Peak memory per rank is the process's resident high-water
mark above what it held before the model was built (as benchmarks/zero_stages.py measures it).

    .venv/bin/python benchmarks/prepare_vs_peers.py [--world 2] [--steps 6] [--repeats 3] [--out FILE]

Writes benchmarks/results/prepare_vs_peers.json (or --out: command, machine, every figure) and prints the table.
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.runtime.launch import launch
from minitrain.train.memory import DevicePeak
from minitrain.train.metrics import format_table, human_bytes

GPT2 = dict(vocab_size=8192, n_positions=128, n_embd=320, n_layer=6, n_head=5, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
BATCH, SEQ, WARMUP = 2, 128, 2
PEER_OF = {"zero0": "ddp", "zero1": "zero-redundancy", "zero2": "fsdp2-zero2", "zero3": "fsdp2"}
CONFIGS = [*PEER_OF, *PEER_OF.values()]


def _groups(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _build(name: str, topo):
    """(module to call, optimizer, parameters to clip or None for minitrain's clip) for one configuration."""
    import torch
    import transformers

    import minitrain

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95))
    if name in PEER_OF:
        minitrain.init_distributed(topology=topo)
        model, opt = minitrain.prepare(model, adamw, zero=int(name[-1]), param_groups=_groups(model))
        return model, opt, None
    if name in ("ddp", "zero-redundancy"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model, process_group=topo.dp.group)
        groups = _groups(model)
        if name == "ddp":
            return module, adamw(groups), list(model.parameters())
        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                      process_group=topo.dp.group, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        opt.add_param_group(groups[1])
        return module, opt, list(model.parameters())
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(topo.dp.group, "cpu")
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=name == "fsdp2")
    fully_shard(model, mesh=mesh, reshard_after_forward=name == "fsdp2")
    return model, adamw(_groups(model)), list(model.parameters())


def worker(topo, name: str, steps: int) -> dict:
    """One configuration in fresh processes: median step time and peak memory above the pre-model baseline."""
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
    g = torch.Generator().manual_seed(1 + topo.rank)
    times, peaks, first_loss = [], [], None
    for _ in range(WARMUP + steps):
        x = torch.randint(0, GPT2["vocab_size"], (BATCH, SEQ), generator=g)
        peak.reset()
        topo.dp.barrier()
        start = time.perf_counter()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        if clip_params is None:
            minitrain.clip_grad_norm_(model, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(clip_params, 1.0)
        opt.step()
        opt.zero_grad()
        topo.dp.barrier()
        times.append(time.perf_counter() - start)
        peaks.append(peak.bytes() - baseline)
        first_loss = first_loss if first_loss is not None else float(loss.detach())
    peak.close()
    return {"step_s": statistics.median(times[WARMUP:]), "peak_bytes": max(peaks), "first_loss": first_loss}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "prepare_vs_peers.json"), help="the result file")
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # inherited by the ranks: RSS follows tensors
    runs = []
    for r in range(args.repeats):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        run = {}
        for name in order:
            per_rank = launch(worker, args.world, name, args.steps, backend="gloo", timeout_s=1800)
            run[name] = {"step_s": max(p["step_s"] for p in per_rank), "peak_bytes": max(p["peak_bytes"] for p in
                                                                                       per_rank),
                         "first_loss": per_rank[0]["first_loss"]}
        runs.append(run)
        print(f"repeat {r + 1}: " + ", ".join(f"{n} {1000 * run[n]['step_s']:.0f} ms" for n in CONFIGS),
              file=sys.stderr, flush=True)
    results, rows = {}, []
    for ours, peer in PEER_OF.items():
        entry = {"peer": peer}
        for name in (ours, peer):
            entry[name] = {"step_ms": median_range([1000 * run[name]["step_s"] for run in runs]),
                           "peak_bytes": median_range([run[name]["peak_bytes"] for run in runs]),
                           "first_loss": runs[0][name]["first_loss"]}
        entry["time_ratio"] = median_range([run[ours]["step_s"] / run[peer]["step_s"] for run in runs])
        entry["memory_ratio"] = median_range([run[ours]["peak_bytes"] / run[peer]["peak_bytes"] for run in runs])
        results[ours] = entry
        rows.append([ours, peer, f"{entry[ours]['step_ms'][0]:.0f}", f"{entry[peer]['step_ms'][0]:.0f}",
                     fmt_range(entry["time_ratio"], "{:.2f}"), human_bytes(entry[ours]["peak_bytes"][0]),
                     human_bytes(entry[peer]["peak_bytes"][0]), fmt_range(entry["memory_ratio"], "{:.2f}")])
    import transformers

    params = sum(p.numel() for p in transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).parameters())
    out = write_result(args.out, __file__, argv, {
        "model": {"gpt2_config": GPT2, "parameters": params}, "batch_per_rank": BATCH, "seq": SEQ,
        "world": args.world, "steps": args.steps, "warmup": WARMUP, "repeats": args.repeats,
        "format": "each figure is [median, min, max] over repeats; ratios are ours / peer within a repeat",
        "results": results}, transformers=transformers.__version__)
    print(format_table(["ours", "peer", "ours ms", "peer ms", "time ratio", "ours peak", "peer peak", "memory ratio"],
                       rows, "<<>>>>>>"))
    print(f"GPT-2 {params / 1e6:.1f}M parameters, {args.world} ranks; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
