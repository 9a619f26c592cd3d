"""Expert parallelism (`--dist.ep N`): each rank of a group of N computes 1/N of every mixture-of-experts layer's
experts, and tokens travel to them and back by all-to-all.

The data-parallel ranks are cut into groups of N consecutive ranks; within a group, rank g computes experts
[g*E/N, (g+1)*E/N) of every layer. A layer's forward on one rank (models/minigpt/moe.py routes, this moves):
1. its routed rows, grouped by expert, are grouped by the rank that computes them too (experts are numbered
   in rank order); every rank tells every other how many rows it sends for each of its experts (an all-to-all
   of E counts);
2. the rows go out in one all-to-all of uneven sizes (`Comm.all_to_all_uneven`: counted, timed and watched as
   every collective); what arrives is regrouped by local expert, each local expert computes all its rows, from
   every rank, in one batch (an expert that got none runs on none);
3. the outputs go back by the reverse all-to-all into the sender's row order, and the sender combines them as
   without expert parallelism.
Backward runs the same exchanges the other way (the all-to-all's gradient is the reverse all-to-all).

What changes is where each expert's arithmetic happens, not what it is: the routing, capacity drops and
combination are each rank's own, as at ep = 1, so the run equals data parallelism over the same ranks (to
float rounding: an expert's matrix multiplies see its rows from every rank at once).

Where the weights live (shard_experts, for `minitrain train --dist.ep` and `minitrain.prepare(..., ep=)`): each
rank holds only its experts, marked as slices of the whole tensors; the data-parallel group becomes the experts'
replicas (Topology.with_experts), every rank reads its own data, and the strategy averages every gradient over
the replicas, then sums the dense parameters' over the ep group and divides all by ep (FlatStrategy.use_experts):
the average over every rank, for the weights each holds. (ExpertParallel also runs with every expert held on
every rank, held_here=False, computing only its own: the others' zero contributions keep an average right.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...runtime.comm import Comm
from ..state.slices import sharded_parameter


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by in_splits, from ranks by out_splits; backward: the gradient the reverse way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        comm.all_to_all_uneven(out, rows.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all_uneven(back, grad.contiguous(), ctx.in_splits, ctx.out_splits)
        return back, None, None, None


class ExpertParallel:
    """A layer's run_experts when its experts are spread over `comm` (one expert-parallel group). held_here: the
    layer's expert weights are this rank's experts only (shard_experts), so local expert i is weight row i; else
    every rank holds them all and computes its own."""

    def __init__(self, layer, comm: Comm, held_here: bool = False):
        if layer.experts % comm.world_size:
            raise ValueError(f"{layer.experts} experts cannot be split evenly over {comm.world_size} ranks")
        self.layer, self.comm = layer, comm
        self.per_rank = layer.experts // comm.world_size
        first = 0 if held_here else comm.rank * self.per_rank
        self.local = range(first, first + self.per_rank)

    def __call__(self, inputs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ranks, per = self.comm.world_size, self.per_rank
        send = torch.tensor(counts, dtype=torch.int64, device=self.comm.device)
        arriving = torch.empty_like(send)
        self.comm.all_to_all(arriving, send)  # arriving[i * per + j]: rows rank i sends for local expert j
        send_counts, arriving_counts = send.view(ranks, per), arriving.view(ranks, per)
        in_splits, out_splits = send_counts.sum(1).tolist(), arriving_counts.sum(1).tolist()
        received = _AllToAll.apply(inputs, self.comm, out_splits, in_splits)  # by source rank, then local expert
        by_expert = self._expert_major(arriving_counts.tolist(), received.device)
        outputs = self.layer.expert_outputs(received[by_expert], arriving_counts.sum(0).tolist(), self.local)
        back = torch.empty_like(outputs).index_copy(0, by_expert, outputs)  # the arrival order again
        return _AllToAll.apply(back, self.comm, in_splits, out_splits)

    @staticmethod
    def _expert_major(counts: list[list[int]], device: torch.device) -> torch.Tensor:
        """The row permutation from (source rank, local expert) order to (local expert, source rank) order, built
        on the host from the counts (counts[i][j]: rows from rank i for local expert j)."""
        starts, at = [], 0
        for row in counts:
            starts.append([])
            for n in row:
                starts[-1].append(at)
                at += n
        order = [r for j in range(len(counts[0])) for i in range(len(counts))
                 for r in range(starts[i][j], starts[i][j] + counts[i][j])]
        return torch.tensor(order, dtype=torch.int64, device=device)


def shard_experts(model: torch.nn.Module, comm: Comm, ep_plan: dict | str | None = None) -> int:
    """Expert parallelism that also splits the weights: every layer that routes its own tokens (or, with an
    ep_plan, every Hugging Face experts module it names) keeps only this rank's E/ep experts (rows
    [g E/ep, (g+1) E/ep) of each expert tensor, g = comm.rank), each marked as a slice of the whole tensor
    (`slices`, as tensor parallelism marks its own), so checkpoints hold whole tensors under the model's keys and
    reload at any ep. Returns how many layers."""
    if ep_plan is not None:
        modules = hugging_face_experts(model, ep_plan)
        for module in modules:
            experts = HuggingFaceExperts(module)
            _keep_own_experts(module, HuggingFaceExperts.WEIGHTS, experts.experts, comm)
            module.forward = dispatching_forward(experts, comm, held_here=True)
        return len(modules)
    layers = [m for m in model.modules() if routes_its_own_tokens(m)]
    for layer in layers:
        _keep_own_experts(layer, layer.expert_weights, layer.experts, comm)
        layer.run_experts = ExpertParallel(layer, comm, held_here=True)
    return len(layers)


def _keep_own_experts(module: torch.nn.Module, names, experts: int, comm: Comm) -> None:
    """This rank's rows of each per-expert tensor `names` of `module`, as slices of the whole (module.slices)."""
    per = experts // comm.world_size
    rows = torch.arange(comm.rank * per, (comm.rank + 1) * per, device="cpu")
    module.slices = {}
    for name in names:
        param, module.slices[name] = sharded_parameter(getattr(module, name), 0, rows)
        setattr(module, name, param)


def balance_over_the_batch(model: torch.nn.Module, data: Comm) -> None:
    """Tell each mixture-of-experts layer that balances its routing (MiniGPT's: `balance_over`) which ranks split
    the batch: under moe_balance "global" it counts the balancing loss's token fractions over all of them."""
    for layer in model.modules():
        if routes_its_own_tokens(layer) and hasattr(layer, "balance_over"):
            layer.balance_over(data)


def routes_its_own_tokens(module: torch.nn.Module) -> bool:
    """A layer that routes its tokens itself, hands the rows to run_experts and names its per-expert tensors
    (expert_weights, expert first): MiniGPT's MoEMLP."""
    return all(hasattr(module, a) for a in ("experts", "run_experts", "expert_outputs", "expert_weights"))


class HuggingFaceExperts:
    """The expert arithmetic of a Hugging Face experts module (Mixtral's, Qwen2-MoE's, OLMoE's: `gate_up_proj`
    (E, 2F, D), `down_proj` (E, D, F), `act_fn`; forward(hidden_states, top_k_index, top_k_weights)), for
    ExpertParallel."""

    WEIGHTS = ("gate_up_proj", "down_proj")  # the per-expert tensors, expert first

    def __init__(self, module: torch.nn.Module):
        missing = [a for a in (*self.WEIGHTS, "act_fn") if not hasattr(module, a)]
        if missing:
            raise ValueError(f"{type(module).__name__} is not a Hugging Face experts module (it has no "
                             f"{', '.join(missing)}): expert parallelism knows Mixtral's layout (gate_up_proj, "
                             "down_proj, act_fn)")
        self.module, self.experts = module, module.gate_up_proj.shape[0]  # read before any split: all of them

    def expert_outputs(self, inputs: torch.Tensor, counts: list[int], experts) -> torch.Tensor:
        m, parts = self.module, []
        for e, rows in zip(experts, inputs.split(counts)):
            gate, up = F.linear(rows, m.gate_up_proj[e]).chunk(2, dim=-1)
            parts.append(F.linear(m.act_fn(gate) * up, m.down_proj[e]))
        return torch.cat(parts)


def dispatching_forward(experts: HuggingFaceExperts, comm: Comm, held_here: bool = False):
    """A Hugging Face experts module's forward under expert parallelism: the (token, choice) slots grouped by
    expert (stable: token order within an expert), their rows computed where their experts are, and each token's
    k outputs summed with its routing weights, in choice order."""
    parallel = ExpertParallel(experts, comm, held_here)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        N, k = top_k_index.shape
        slot_expert = top_k_index.reshape(-1)
        order = torch.argsort(slot_expert, stable=True)
        counts = torch.bincount(slot_expert, minlength=experts.experts).tolist()
        computed = parallel(hidden_states[order // k], counts)
        outputs = computed.new_zeros(N * k, hidden_states.size(-1))  # the experts' dtype (autocast)
        outputs[order] = computed
        weights = top_k_weights.to(outputs.dtype).unsqueeze(-1)
        return (outputs.view(N, k, -1) * weights).sum(dim=1).to(hidden_states.dtype)

    return forward


def hugging_face_experts(model: torch.nn.Module, ep_plan) -> list[torch.nn.Module]:
    """The experts modules an ep_plan names: "auto" reads a Hugging Face config's `base_model_ep_plan` (its
    `ep_dispatch_experts` entries, names under the base model); a dict {module-name pattern: "experts"} names a
    model's own modules of that layout. ValueError if none matches."""
    from ..core.model_plan import matches

    if ep_plan == "auto":
        base = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        inner = prefix if prefix and hasattr(model, prefix) else ""
        patterns = [f"{inner}.{k}" if inner else k for k, style in base.items() if style == "ep_dispatch_experts"]
        if not patterns:
            raise ValueError(f"ep_plan='auto' reads a Hugging Face model's own expert plan, and "
                             f"{type(model).__name__} ships none (config.base_model_ep_plan names no experts)")
    elif isinstance(ep_plan, dict):
        bad = {style for style in ep_plan.values() if style != "experts"}
        if bad:
            raise ValueError(f"ep_plan styles are 'experts' (a module with gate_up_proj, down_proj and act_fn, "
                             f"called with (hidden_states, top_k_index, top_k_weights)); got {sorted(bad)}")
        patterns = list(ep_plan)
    else:
        raise ValueError(f"ep_plan must be 'auto' or {{module pattern: 'experts'}}, got {ep_plan!r}")
    found = [m for name, m in model.named_modules() if name and any(matches(p, name) for p in patterns)]
    if not found:
        raise ValueError(f"ep_plan matches no module of {type(model).__name__} ({', '.join(patterns)})")
    return found
