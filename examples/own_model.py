"""Your own nn.Module, optimizer and training loop, data parallel with ZeRO, through minitrain's API.

    python examples/own_model.py                                   # one process
    torchrun --nproc-per-node=2 examples/own_model.py --zero 2     # two ranks (gloo on CPU, NCCL on GPUs)

Each rank trains on its own share of every global batch; minitrain averages the gradients, shards the
optimizer state (and at --zero 2 the gradients, at --zero 3 the parameters), clips by the true global norm
and saves a checkpoint that `minitrain ckpt consolidate OUT OUT/model.safetensors` turns back into this
model's own state_dict.
"""
import argparse
import functools

import torch
import torch.nn.functional as F
from torch import nn

import minitrain


class TinyLM(nn.Module):
    """A small next-token model: embedding, residual MLP layers, a head; plus a persistent buffer."""

    def __init__(self, vocab: int = 32, dim: int = 64, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("temperature", torch.tensor(1.0))  # saved and consolidated with the weights

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x) / self.temperature


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zero", type=int, default=1, help="ZeRO stage 0-3 (default 1)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--out", default="runs/own_model", help="checkpoint directory (default runs/own_model)")
    args = parser.parse_args()

    rank, world = minitrain.init_distributed()
    torch.manual_seed(0)  # every rank builds the same model (rank 0's weights win anyway)
    model, optimizer = minitrain.prepare(TinyLM(), functools.partial(torch.optim.AdamW, lr=3e-3), zero=args.zero)
    stream = (torch.arange(1 << 14) * 7) % 32  # a sequence with structure to learn
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(stream) - 17, (8 * world,), generator=torch.Generator().manual_seed(step))
        windows = stream[starts[rank::world, None] + torch.arange(17)]  # this rank's 8 of the global batch
        logits = model(windows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        loss.backward()
        norm = minitrain.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if minitrain.is_main_process() and (step % 20 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad_norm {norm:.3f}", flush=True)
    path = minitrain.save_checkpoint(args.out, model, optimizer, args.steps)
    if minitrain.is_main_process():
        print(f"saved {path}")
    minitrain.cleanup()


if __name__ == "__main__":
    main()
