"""Experiment 35: data parallel on the CPU with stock PyTorch DDP, in the DDP lab's shape.

From the repository's root, after the README's set-up command (`.venv/bin` first on the PATH):

    torchrun --nnodes=1 --nproc-per-node=2 experiments/35-ddp-cpu/train.py [--out DIR]

Each rank seeds with 35000 + rank, builds the tiny GPT, wraps it in DistributedDataParallel (default buckets)
and trains 100 steps of AdamW (lr 3e-4) on its shard of the examples (make_shard: example i on rank
i % world_size). A communication hook times each bucket's all-reduce (wall time, launch to completion; the
same sum-then-divide as DDP's default). Rank 0 then trains the same model alone on the same global batch, for
the one-process figure. Written to DIR (default: this directory):
  timings.jsonl      one line per step: loss, step ms, all-reduce ms (rank 0's)
  manifest.json      all-reduce p50/p95 ms, tokens/s at 1 and 2 processes, and why they differ here
  scaling.png        tokens/s at 1 and 2 processes
  state-rank-0.pt    each rank's final state_dict (tensors only: read with torch.load(..., weights_only=True));
  state-rank-1.pt    DDP keeps the replicas equal (within 1e-5)
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitrain.config import ModelConfig
from minitrain.data import LAB_SEQ_LEN, LAB_VOCAB, make_shard
from minitrain.ddp import barrier, cleanup, init_distributed, is_main_process, wrap_for_ddp
from minitrain.models.minigpt.model import MiniGPT

STEPS, LR, BATCH, SEED = 100, 3e-4, 8, 35000


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MiniGPT(ModelConfig(n_layer=2, d_model=64, n_head=4, vocab_size=LAB_VOCAB, seq_len=LAB_SEQ_LEN))


def timed_allreduce(times: list, bucket):
    """DDP's default hook (sum over ranks, divided by the world size), timed from launch to completion."""
    start, world = time.perf_counter(), dist.get_world_size()
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def done(fut):
        times.append(1000 * (time.perf_counter() - start))
        return fut.value()[0].div_(world)

    return future.then(done)


def train(model, shard: torch.Tensor, seed: int, batch: int, on_step=None) -> list[dict]:
    """The lab's loop: sample a batch of this rank's examples, next-token loss, backward, AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for step in range(1, STEPS + 1):
        start = time.perf_counter()
        examples = shard[torch.randint(0, len(shard), (batch,), generator=gen)]
        logits = model(examples[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), examples[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        rows.append({"step": step, "loss": loss.item(), "step_ms": 1000 * (time.perf_counter() - start)})
        if on_step is not None:
            on_step(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent), help="where the outputs go")
    out = Path(parser.parse_args().out)
    torch.set_num_threads(1)  # one thread per rank: the two ranks share this machine's cores
    rank, world = init_distributed()
    out.mkdir(parents=True, exist_ok=True)
    model = wrap_for_ddp(build_model(SEED + rank))  # DDP broadcasts rank 0's parameters
    allreduce_ms: list[float] = []
    model.register_comm_hook(allreduce_ms, timed_allreduce)
    shard = make_shard(rank, world)
    step_allreduce = []

    def note(row):  # the step's buckets, summed
        row["allreduce_ms"] = sum(allreduce_ms[len(step_allreduce):]) if allreduce_ms else 0.0
        step_allreduce.extend(allreduce_ms[len(step_allreduce):])

    rows = train(model, shard, SEED + rank, BATCH, note)
    torch.save(model.module.state_dict(), out / f"state-rank-{rank}.pt")
    barrier()
    if is_main_process():
        torch.set_num_threads(os.cpu_count() or 1)  # one process alone gets the whole machine
        alone = train(build_model(SEED), make_shard(0, 1), SEED, BATCH * world)
        write_outputs(out, rows, alone, allreduce_ms, world, sum(p.numel() for p in model.parameters()))
    barrier()
    cleanup()


def write_outputs(out: Path, rows: list[dict], alone: list[dict], allreduce_ms: list[float], world: int,
                  params: int) -> None:
    with open(out / "timings.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tokens = BATCH * world * LAB_SEQ_LEN  # per step, over all ranks: the same global batch in both runs
    together = tokens / (statistics.median(r["step_ms"] for r in rows[10:]) / 1000)
    single = tokens / (statistics.median(r["step_ms"] for r in alone[10:]) / 1000)
    p50, p95 = (statistics.quantiles(allreduce_ms, n=100)[q] for q in (49, 94))
    cores = os.cpu_count() or 1
    why = (f"{world} processes reach {together:,.0f} tokens/s against {single:,.0f} for one: "
           + ("slower here. " if together < single else "faster here, but by less than the processes' count. ")
           + f"This machine has {cores} CPU core(s), so the {world} ranks (one thread each) share the cores the single "
           f"process used for its matrix multiplies: the arithmetic gets no more hardware, while every step adds an "
           f"all-reduce of the {params:,} gradients ({4 * params:,} bytes; p50 {p50:.2f} ms, p95 {p95:.2f} ms) through "
           "gloo on the loopback interface, and a second Python interpreter's overhead. Data parallelism pays when "
           "each rank brings hardware of its own: a GPU, or a node.")
    manifest = {"experiment": "35-ddp-cpu", "command": "torchrun --nnodes=1 --nproc-per-node=2 "
                "experiments/35-ddp-cpu/train.py", "steps": STEPS, "lr": LR, "seed": "35000 + rank",
                "batch_per_rank": BATCH, "seq_len": LAB_SEQ_LEN, "parameters": params,
                "allreduce_ms": {"p50": p50, "p95": p95, "buckets": len(allreduce_ms)},
                "tokens_per_s": {"1": single, str(world): together}, "why": why,
                "files": ["timings.jsonl", "scaling.png", "manifest.json"] + [f"state-rank-{r}.pt" for r in range(world)]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(["1 process", f"{world} processes"], [single, together], color=["#888888", "#3465a4"])
    ax.set_ylabel("tokens/s")
    ax.set_title("Experiment 35: DDP on the CPU")
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
