"""Our 1F1B pipeline against PyTorch's `torch.distributed.pipelining.Schedule1F1B` on the same model.

Both split MiniGPT (`small` preset: 4 blocks, d_model 256, 8 heads, seq 128, vocab 256) into `--pp`
stages with MiniGPT's plan (`minigpt_plan.pipeline_split`) (the same contiguous blocks, the embeddings on the first stage,
the head on the last), from the same initial weights, and run one batch of 8 sequences cut into
`--microbatches` micro-batches through the 1F1B schedule: ours with `Pipeline`, PyTorch's with a
`PipelineStage` per rank and `Schedule1F1B` (its loss function is the same mean cross-entropy, and it
scales the gradients by 1/M as we do). Timed: forward + backward of the batch (no optimizer: neither
is pipeline work), barrier to barrier over the pipeline group, median over steps after warmup; the
first loss of both is printed as a check that they compute the same thing. Both run in one launch, each over
its own copy of the weights, in turns on the same batches (which goes first alternating batch by batch), so a
slow spell of the shared machine slows both; ratio = the median over batches of ours / PyTorch's on that batch,
and its median over repeats (one launch each).

    .venv/bin/python benchmarks/pipeline.py [--pp 2] [--microbatches 4] [--steps 16] [--repeats 3] [--out FILE]

With --virtual-stages V (2 or more) the schedules are interleaved: ours with MiniGPT's plan's chunks
(`pipeline_chunks`: pp x V chunks, rank s holding s, s + P, ...), PyTorch's `ScheduleInterleaved1F1B` with one
`PipelineStage` per chunk over the same modules; the model then has --layers blocks (default 8, so that pp 4 x V 2
chunks divide them).

Writes benchmarks/results/pipeline_pp{P}_m{M}.json, or pipeline_interleaved_pp{P}_m{M}_v{V}.json (or --out:
command, machine, every figure).
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from against_peer import compare_in_turn, time_in_turn, write_and_print  # benchmarks/against_peer.py
from record import RESULTS  # benchmarks/record.py


from minitrain.train.run_config import run_config
from minitrain.data import ShardedLoader, load_corpus
from minitrain.runtime.launch import launch
from minitrain.models.minigpt.model import MiniGPT
from minitrain.models.minigpt.plan import pipeline_chunks, pipeline_split
from minitrain.parallel.pipeline_parallel.executor import Pipeline

MODEL = {"model.preset": "small", "train.batch_size": 8, "data.synthetic_tokens": 1 << 18, "train.log_every": 0}
WARMUP = 2


def _loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _torch_step(schedule, pp):
    """One batch through PyTorch's schedule: the first stage feeds the inputs, the last the targets."""
    def step(x, y):
        losses = []
        if pp.rank == 0:
            schedule.step(x)
        elif pp.rank == pp.world_size - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        return torch.stack(losses).mean() if losses else None

    return step


def _torch_schedule(stage_model, topo, cfg, microbatches):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp = topo.pp
    stage = PipelineStage(stage_model, pp.rank, pp.world_size, topo.device, group=pp.group)
    return _torch_step(Schedule1F1B(stage, microbatches, loss_fn=_loss_fn), pp)


class _Chunk(torch.nn.Module):
    """One of our chunks as the module PyTorch's PipelineStage runs: input in, activation (or logits) out."""

    def __init__(self, model: torch.nn.Module, run):
        super().__init__()
        self.model, self.run = model, run

    def forward(self, x):
        return self.run(x, None)


def _torch_interleaved(model, chunks, topo, microbatches):
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    pp, V = topo.pp, len(chunks)
    stages = [PipelineStage(_Chunk(model, run), c * pp.world_size + pp.rank, pp.world_size * V, topo.device,
                            group=pp.group) for c, run in enumerate(chunks)]
    return _torch_step(ScheduleInterleaved1F1B(stages, microbatches, loss_fn=_loss_fn), pp)


def _stage_model(cfg, rank: int, pp_size: int, virtual: int):
    """MiniGPT from the run's seed, split for this rank: (the model, its chunks' forwards or None)."""
    torch.manual_seed(cfg.train.seed)
    model = MiniGPT(cfg.model)
    if virtual > 1:
        return model, pipeline_chunks(model, rank, pp_size, virtual)
    pipeline_split(model, rank, pp_size)  # MiniGPT's plan: this rank's stage, in place
    return model, None


def _our_step(model, chunks, topo, cfg, microbatches):
    pipeline = Pipeline(model, topo.pp, "interleaved" if chunks else "1f1b", microbatches, cfg.model.d_model,
                        torch.float32, topo.device, contextlib.nullcontext, contextlib.nullcontext, chunks,
                        measure=False)  # as prepare runs it: no bubble measured, as PyTorch's schedules

    def step(x, y):
        loss = pipeline.run(x, y, 1.0, sync=True)  # as a training step's last micro-batch runs it
        return loss if pipeline.last_stage else None

    return step


def worker(topo, pp_size: int, microbatches: int, steps: int, virtual: int = 1, layers: int = 8) -> dict:
    """Both pipelines in this process, each over its own copy of the same initial weights, timed in turns on the
    same batches (`time_in_turn`)."""
    topo = topo.with_layout(1, pp_size)
    cfg = run_config(cli_values={**MODEL, "dist.nproc": topo.world_size, "dist.pp": pp_size,
                                   "dist.microbatches": microbatches,
                                   **({"model.n_layer": layers} if virtual > 1 else {})})
    ours, torch_model = (_stage_model(cfg, topo.pp.rank, pp_size, virtual) for _ in range(2))
    theirs = (_torch_interleaved(*torch_model, topo, microbatches) if virtual > 1
              else _torch_schedule(torch_model[0], topo, cfg, microbatches))

    def zero_grad(set_to_none=True):
        for model in (ours[0], torch_model[0]):
            model.zero_grad(set_to_none=set_to_none)

    loader = ShardedLoader(load_corpus(cfg), cfg.model.seq_len, cfg.train.batch_size, 0, 1, cfg.train.seed)
    return time_in_turn({"minitrain": _our_step(*ours, topo, cfg, microbatches), "torch": theirs}, zero_grad, loader,
                        topo.pp, steps, WARMUP)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--virtual-stages", type=int, default=1, help="2 or more: the interleaved schedules")
    parser.add_argument("--layers", type=int, default=8, help="blocks of the model when interleaved (default 8)")
    parser.add_argument("--out", help="the result file (default benchmarks/results/pipeline_pp{P}_m{M}.json)")
    args = parser.parse_args(argv)
    V = args.virtual_stages
    out = args.out or RESULTS / (f"pipeline_interleaved_pp{args.pp}_m{args.microbatches}_v{V}.json" if V > 1
                                 else f"pipeline_pp{args.pp}_m{args.microbatches}.json")
    # The loss lives on the last stage: take that rank's result.
    report, ratio = compare_in_turn(lambda: launch(worker, args.pp, args.pp, args.microbatches, args.steps, V,
                                                   args.layers, backend="gloo", timeout_s=1800)[-1], "torch",
                                    args.repeats)
    model = {**MODEL, "model.n_layer": args.layers} if V > 1 else MODEL
    write_and_print(out, __file__, argv,
                    {"model": model, "pp": args.pp, "microbatches": args.microbatches,
                     "schedule": "interleaved" if V > 1 else "1f1b", "virtual_stages": V,
                     "steps": args.steps, "warmup": WARMUP, "repeats": args.repeats},
                    report, ratio, "interleaved pipeline" if V > 1 else "1F1B pipeline", "torch.distributed.pipelining")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
