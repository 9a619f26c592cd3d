"""A mixture of experts in place of a block's MLP (`--model.moe_experts E --model.moe_top_k k`).

A router (a linear map to E logits, no bias) scores every token; each token goes to its k most probable
experts, whose outputs are summed with the router's top-k probabilities renormalised to sum to 1 (Mixtral;
with k = 1 the probability itself, as Switch). An expert is MiniGPT's MLP (up, GELU, down). The experts' weights
are 3-D tensors with the expert first, `up` (E, F, D) and `down` (E, D, F), as Hugging Face stores Mixtral's and
Qwen-MoE's: expert parallelism splits them along that first dimension.

Routing, step by step, in an order that does not depend on where the experts run:
- every (token, choice) pair is a slot, numbered token-major (token t's j-th choice is slot t*k + j);
- the slots are grouped by expert, in slot order within an expert (a stable sort): an expert computes its tokens
  in one batch;
- with a capacity factor c, an expert takes at most C = ceil(c * tokens * k / E) slots, the first C in slot
  order; the others are dropped (they add nothing: the token keeps its residual stream) and counted. 0 is
  dropless (every slot is computed);
- the outputs go back to their slots, and each token sums its k slots in choice order, weighted.

Two losses keep the router honest, added to the model's loss (MiniGPT.output) with their coefficients:
- load balancing (Switch Transformer, Fedus et al. 2021; GShard): E * sum_e f_e * P_e, where f_e is the fraction
  of slots routed to expert e (before any drop) and P_e the mean router probability of e. It is 1 when both are
  uniform and grows as the router favours a few experts. Over which tokens (`moe_balance`): `rank` counts f_e and
  P_e over this rank's tokens, so the loss depends on how the batch is split; `global` (once `balance_over` names
  the ranks that split the batch) sums the E counts over them first, an all-reduce of E + 1 numbers (it runs
  again when activation checkpointing replays the forward, as the experts' all-to-alls do). f_e carries no
  gradient and each rank's share of the batch is the same size, so each rank's E * sum_e f_e * P_e(rank), averaged
  over the ranks as the gradients are, is the loss over the whole batch: N ranks train as one process;
- z-loss (ST-MoE, Zoph et al. 2022): the mean over tokens of logsumexp(logits)^2, keeping the logits small.

The layer also counts, per training forward, the slots each expert received, the slots dropped and its auxiliary
losses' value, which the trainer reads and clears after each step (`take_load`). A forward that activation
checkpointing replays inside backward computes the same routing again but counts nothing, nor does an
evaluation's: the step's figures are its forward's, once.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...config import ModelConfig
from ...parallel.recompute import in_backward
from ...parallel.expert_parallel.load import ExpertLoad


def widened(logits: torch.Tensor) -> torch.Tensor:
    """The router's logits in float32 at least: a 16-bit softmax would round the routing weights coarsely."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


class MoEMLP(nn.Module):
    expert_weights = ("up", "up_bias", "down", "down_bias")  # the per-expert tensors, expert first

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, Fd = cfg.moe_experts, cfg.d_model, cfg.ffn_dim
        self.experts, self.top_k, self.capacity_factor = E, cfg.moe_top_k, cfg.moe_capacity_factor
        self.aux_coef, self.z_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.balance = cfg.moe_balance
        self.balance_comm = None  # the ranks whose tokens f_e counts over (balance_over); None: this rank's
        self.router = nn.Linear(D, E, bias=False)
        self.up = nn.Parameter(torch.empty(E, Fd, D))
        self.up_bias = nn.Parameter(torch.zeros(E, Fd))
        self.down = nn.Parameter(torch.empty(E, D, Fd))
        self.down_bias = nn.Parameter(torch.zeros(E, D))
        nn.init.normal_(self.up, mean=0.0, std=0.02)
        nn.init.normal_(self.down, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))  # writes into the residual
        # This step's counts: plain numbers, not buffers (a buffer would be cast with the model, and PyTorch's DDP
        # would overwrite every rank's with rank 0's).
        self.counted = ExpertLoad([0.0] * E)
        self.aux_loss: torch.Tensor | None = None  # the last forward's weighted auxiliary losses (MiniGPT.output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        N, E, k = tokens.size(0), self.experts, self.top_k
        logits = self.router(tokens)  # (N, E)
        probs = widened(logits).softmax(dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # (N, k), most probable first
        if k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        slot_expert = chosen.reshape(-1)  # (N*k,) token-major
        order = torch.argsort(slot_expert, stable=True)  # slots grouped by expert, in slot order within each
        counts = torch.bincount(slot_expert, minlength=E)
        keep = self._within_capacity(slot_expert[order], counts, N)
        kept_order = order[keep] if keep is not None else order
        kept_counts = counts if keep is None else torch.bincount(slot_expert[kept_order], minlength=E)
        computed = self.run_experts(tokens[kept_order // k], kept_counts.tolist())
        # In the experts' dtype: under CUDA autocast their input (a layer norm's) is float32, their output 16-bit.
        outputs = computed.new_zeros(N * k, shape[-1])
        outputs[kept_order] = computed
        mixed = (outputs.view(N, k, -1) * weights.to(outputs.dtype).unsqueeze(-1)).sum(dim=1)
        # Only a forward that will be differentiated needs them (an evaluation's would wait on the other ranks).
        self.aux_loss = self._aux_losses(logits, probs, counts, N) if torch.is_grad_enabled() else None
        if self.training and not in_backward():  # a training forward's load, once (not evaluation's, not a replay)
            self._count(counts.tolist(), float(N * k - kept_order.numel()))
        return mixed.view(shape)

    def run_experts(self, inputs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts' outputs for `inputs`, rows grouped by expert (counts[e] rows for expert e), in that order.
        Expert parallelism (parallel/expert_parallel/experts.py) replaces this on the instance: the rows then travel to the
        ranks that hold their experts and back."""
        return self.expert_outputs(inputs, counts, range(self.experts))

    def expert_outputs(self, inputs: torch.Tensor, counts: list[int], experts) -> torch.Tensor:
        """Expert experts[i] on the next counts[i] rows of inputs. Each runs, on no rows if none came: its weights
        then get a zero gradient, as a parameter that took part."""
        parts = []
        for e, rows in zip(experts, inputs.split(counts)):
            h = F.gelu(F.linear(rows, self.up[e], self.up_bias[e]))
            parts.append(F.linear(h, self.down[e], self.down_bias[e]))
        return torch.cat(parts)

    def _within_capacity(self, sorted_experts: torch.Tensor, counts: torch.Tensor, N: int) -> torch.Tensor | None:
        """Which of the expert-sorted slots an expert takes: the first C of each (None: all, dropless)."""
        if not self.capacity_factor:
            return None
        capacity = math.ceil(self.capacity_factor * N * self.top_k / self.experts)
        starts = torch.cumsum(counts, dim=0) - counts  # where each expert's slots begin in the sorted order
        position = torch.arange(sorted_experts.numel(), device=counts.device) - starts[sorted_experts]
        return position < capacity

    def balance_over(self, comm) -> None:
        """Count the balancing loss's f_e over the tokens of `comm`'s ranks (the ranks that each read their own
        share of the batch), under moe_balance "global"; under "rank", or a group of one, over this rank's."""
        self.balance_comm = comm if self.balance == "global" and comm.world_size > 1 else None

    def _aux_losses(self, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, N: int) -> torch.Tensor:
        routed = torch.cat([counts, counts.new_tensor([N * self.top_k])]).to(torch.float64)
        if self.aux_coef and self.balance_comm is not None:
            self.balance_comm.all_reduce_sum(routed)  # every rank's counts, and slots, as one batch's
        fraction = (routed[:-1] / routed[-1]).to(probs.dtype)  # f_e: routed slots (no gradient)
        balance = self.experts * (fraction * probs.mean(dim=0)).sum()
        loss = self.aux_coef * balance
        if self.z_coef:
            loss = loss + self.z_coef * torch.logsumexp(widened(logits), dim=-1).pow(2).mean()
        return loss

    def _count(self, counts: list[int], dropped: float) -> None:
        c = self.counted
        c.load = [a + b for a, b in zip(c.load, counts)]
        c.dropped += dropped
        if self.aux_loss is not None:  # its value stays on the device: the step's exchange reads it
            c.router_loss = c.router_loss + self.aux_loss.detach()
            c.forwards += 1

    def take_load(self) -> ExpertLoad:
        """What the training forwards counted since the last call, and the counters cleared."""
        counted, self.counted = self.counted, ExpertLoad([0.0] * self.experts)
        return counted
