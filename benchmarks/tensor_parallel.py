"""Our tensor parallelism against PyTorch's DTensor `parallelize_module` on the same model.

--model minigpt (default): both split MiniGPT (`small` preset: 4 blocks, d_model 256, 8 heads, seq 128, vocab 256) across
`--tp` ranks from the same initial weights: attention qkv and MLP up column-parallel, attention
output and MLP down row-parallel, the token embedding and the LM head split over the vocabulary,
and a vocabulary-parallel loss (ours; DTensor's `loss_parallel`). DTensor's ColwiseParallel keeps
contiguous rows of qkv, so its qkv weight is permuted first so that those rows are each rank's
q, k and v of its heads (the same computation as ours). Timed: forward + backward of one batch
(the optimizer is left out: ours and torch's AdamW differ, and neither is tensor-parallel work),
median over steps after warmup; the first loss of both is printed as a check that they compute
the same thing. Ratio = ours / DTensor within each repeat; repeats alternate which goes first.

--model llama: a Hugging Face Llama of the same size (4 layers, hidden 256, 8 heads sharing 4 key-value
heads, MLP 688, vocabulary 256, seq 128, batch 8, random init) split by its own plan, the one
`minitrain.prepare(tp=T, tp_plan="auto")` applies: q, k, v, gate and up column-parallel, o and down
row-parallel, the embedding over the vocabulary, the head column-parallel with its logits gathered;
DTensor gets the same plan in its styles. The loss is the loop's own cross-entropy on the whole logits.

    .venv/bin/python benchmarks/tensor_parallel.py [--model minigpt|llama] [--tp 2] [--steps 8] [--repeats 3]

Writes benchmarks/results/tensor_parallel_tp{T}.json (llama: tensor_parallel_llama_tp{T}.json; or --out:
command, machine, every figure).
"""
from __future__ import annotations

import argparse

import torch
from against_peer import compare, time_steps, write_and_print  # benchmarks/against_peer.py
from record import RESULTS  # benchmarks/record.py


from minitrain.train.run_config import run_config
from minitrain.data import ShardedLoader, load_corpus
from minitrain.runtime.launch import launch
from minitrain.models.minigpt.plan import TENSOR_PARALLEL
from minitrain.models.minigpt.model import MiniGPT
from minitrain.parallel.tensor_parallel.plans import apply_tensor_parallel, hugging_face_plan

MODEL = {"model.preset": "small", "train.batch_size": 8, "data.synthetic_tokens": 1 << 18, "train.log_every": 0}
LLAMA = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128}
WARMUP = 2


def _dtensor(model: MiniGPT, tp) -> MiniGPT:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg, n = model.cfg, tp.world_size
    width = cfg.d_model // n
    # Rows of qkv in the order [q, k, v of rank 0's heads, q, k, v of rank 1's heads, ...].
    order = torch.cat([torch.arange(r * width, (r + 1) * width) + part * cfg.d_model
                       for r in range(n) for part in range(3)])
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    with torch.no_grad():
        for name, block in model.blocks.items():
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[order])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[order])
            plan |= {f"blocks.{name}.attn.qkv": ColwiseParallel(), f"blocks.{name}.attn.proj": RowwiseParallel(),
                     f"blocks.{name}.mlp.up": ColwiseParallel(), f"blocks.{name}.mlp.down": RowwiseParallel()}
    mesh = DeviceMesh.from_group(tp.group, "cpu")
    return parallelize_module(model, mesh, plan)


def _llama_dtensor(model, tp):
    """The model's own plan in DTensor's styles."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    plan = {pattern: styles[style]() for pattern, style in hugging_face_plan(model).items()}
    return parallelize_module(model, DeviceMesh.from_group(tp.group, "cpu"), plan)


def llama_worker(topo, tp_size: int, impl: str, steps: int) -> dict:
    import torch.nn.functional as F
    import transformers

    transformers.logging.set_verbosity_error()
    topo = topo.with_layout(tp_size, 1)
    cfg = run_config(cli_values={**MODEL, "dist.nproc": topo.world_size, "dist.tp": tp_size})
    torch.manual_seed(cfg.train.seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False))
    if impl == "minitrain":
        apply_tensor_parallel(model, hugging_face_plan(model), topo.tp)  # what prepare(tp=, tp_plan="auto") does
    else:
        model = _llama_dtensor(model, topo.tp)
    loader = ShardedLoader(load_corpus(cfg), cfg.model.seq_len, cfg.train.batch_size, 0, 1, cfg.train.seed)

    def step(x, y):
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        return loss

    return time_steps(step, model.zero_grad, loader, topo.tp, steps, WARMUP)


def worker(topo, tp_size: int, impl: str, steps: int) -> dict:
    topo = topo.with_layout(tp_size, 1)
    cfg = run_config(cli_values={**MODEL, "dist.nproc": topo.world_size, "dist.tp": tp_size})
    torch.manual_seed(cfg.train.seed)
    model = MiniGPT(cfg.model)
    if impl == "minitrain":
        apply_tensor_parallel(model, TENSOR_PARALLEL, topo.tp)  # MiniGPT's plan
        context = torch.enable_grad
    else:
        from torch.distributed.tensor.parallel import loss_parallel

        model = _dtensor(model, topo.tp)
        context = loss_parallel
    loader = ShardedLoader(load_corpus(cfg), cfg.model.seq_len, cfg.train.batch_size, 0, 1, cfg.train.seed)

    def step(x, y):
        with context():
            loss = model(x, y)
            loss.backward()
        return loss

    return time_steps(step, model.zero_grad, loader, topo.tp, steps, WARMUP)

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("minigpt", "llama"), default="minigpt")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="the result file (default benchmarks/results/tensor_parallel_tp{T}.json)")
    args = parser.parse_args(argv)
    llama = args.model == "llama"
    out = args.out or RESULTS / f"tensor_parallel{'_llama' if llama else ''}_tp{args.tp}.json"
    fn = llama_worker if llama else worker
    report, ratio = compare(lambda impl: launch(fn, args.tp, args.tp, impl, args.steps, backend="gloo",
                                                timeout_s=1800)[0], "dtensor", args.repeats)
    write_and_print(out, __file__, argv,
                    {"model": LLAMA if llama else MODEL, "tp": args.tp, "steps": args.steps, "warmup": WARMUP,
                     "repeats": args.repeats},
                    report, ratio, "tensor parallel", "dtensor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
