"""A Hugging Face Llama (tiny, random initialisation, built from a config: nothing is downloaded) trained
with ZeRO-3 through minitrain's API, under torchrun:

    torchrun --nproc-per-node=2 examples/hf_llama.py --steps 30

The model keeps its class and its state_dict keys; the tied head stays the embedding; weight decay applies to
matrices only (nanoGPT's param groups). The checkpoint consolidates to a file `from_pretrained` loads:

    minitrain ckpt consolidate runs/hf_llama runs/hf_llama/export/model.safetensors
"""
import argparse
import functools

import torch
import torch.nn.functional as F

import minitrain


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zero", type=int, default=3, help="ZeRO stage 0-3 (default 3)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--out", default="runs/hf_llama", help="checkpoint directory (default runs/hf_llama)")
    args = parser.parse_args()

    rank, world = minitrain.init_distributed()
    torch.manual_seed(0)
    model = tiny_llama()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    model, optimizer = minitrain.prepare(model, functools.partial(torch.optim.AdamW, lr=3e-3), zero=args.zero,
                                         param_groups=groups, activation_checkpointing="block")
    tokens = (torch.arange(1 << 14) * 5) % 128  # a learnable pattern
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(tokens) - 33, (4 * world,), generator=torch.Generator().manual_seed(step))
        batch = tokens[starts[rank::world, None] + torch.arange(33)]  # this rank's share
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        norm = minitrain.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if minitrain.is_main_process() and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad_norm {norm:.3f}", flush=True)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    path = minitrain.save_checkpoint(args.out, model, optimizer, args.steps)
    if minitrain.is_main_process():
        print(f"tied head is the embedding: {tied}; saved {path}")
    minitrain.cleanup()


if __name__ == "__main__":
    main()
