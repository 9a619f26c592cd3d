"""Context parallelism in a user's loop: minitrain.prepare(model, optimizer, cp=N) on a Hugging Face Llama (its
attention found through its attention interface, its rotary positions given their absolute offsets) and on
MiniGPT by its plan, against plain PyTorch on one process with the whole sequences, float64, 1e-12; and what it
refuses, saying why."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist import run_ranks
from tests.helpers.hf_models import OPTIMIZERS, make_model
from tests.helpers.refusal import refusal

STEPS, BATCH, LENGTH = 3, 4, 9  # sequences of 9 tokens: 8 inputs and 8 shifted targets


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (BATCH, LENGTH), generator=g) for _ in range(STEPS)]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _reference() -> tuple[list[float], dict]:
    model = make_model("llama")
    optimizer = OPTIMIZERS["adamw"]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for x in _batches():
        loss = _loss(model(input_ids=x[:, :-1]).logits, x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _llama_ranks(topo, cp, style, zero):
    import minitrain

    minitrain.init_distributed(topology=topo)
    model, optimizer = minitrain.prepare(make_model("llama"), OPTIMIZERS["adamw"], zero=zero, cp=cp, cp_style=style)
    rank, readers = minitrain.dp_rank(), minitrain.dp_world_size()
    losses = []
    for x in _batches():
        share = x.chunk(readers)[rank]  # the context group's sequences; each rank keeps its tokens of them
        inputs, targets = minitrain.context_shard(model, share[:, :-1], share[:, 1:])
        loss = _loss(model(input_ids=inputs).logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in minitrain.full_state_dict(model).items()}
    minitrain.cleanup()
    implementation = model.config._attn_implementation  # given back at cleanup
    return losses, state, implementation


@pytest.mark.parametrize("world,cp,style,zero", [(2, 2, "ring", 0), (2, 2, "ulysses", 3), (4, 2, "ring", 2)])
def test_a_hugging_face_llama_at_cp_2_trains_as_one_process_does(world, cp, style, zero):
    want_losses, want = _reference()
    results = run_ranks(_llama_ranks, world, cp, style, zero)
    for rank, (losses, state, implementation) in enumerate(results):
        assert max((state[k] - want[k]).abs().max().item() for k in want) <= 1e-12, (rank, style)
        assert "minitrain" not in implementation
    # The loss of a context group's whole sequences is the mean of its ranks' (each the same number of tokens).
    groups = [results[r:r + cp] for r in range(0, world, cp)]
    means = [[sum(step) / cp for step in zip(*(r[0] for r in group))] for group in groups]
    total = [sum(step) / len(means) for step in zip(*means)]
    assert max(abs(a - b) for a, b in zip(total, want_losses)) <= 1e-12


def _minigpt_ranks(topo):
    import minitrain
    from minitrain.config import ModelConfig
    from minitrain.models.minigpt.model import MiniGPT
    from minitrain.models.minigpt.plan import MINIGPT_PLAN

    minitrain.init_distributed(topology=topo)
    torch.manual_seed(0)
    model, optimizer = minitrain.prepare(MiniGPT(ModelConfig(seq_len=8)).double(), OPTIMIZERS["adamw"], cp=2,
                                         plan=MINIGPT_PLAN)
    for x in _batches():
        model(*minitrain.context_shard(model, x[:, :-1], x[:, 1:])).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.clone() for k, v in minitrain.full_state_dict(model).items()}
    minitrain.cleanup()
    given_back = all("attend" not in block.attn.__dict__ for block in model.blocks.values())  # its own attention
    return state, given_back


def test_minigpt_at_cp_2_by_its_plan_trains_as_one_process_does():
    from minitrain.config import ModelConfig
    from minitrain.models.minigpt.model import MiniGPT

    torch.manual_seed(0)
    plain = MiniGPT(ModelConfig(seq_len=8)).double()
    optimizer = OPTIMIZERS["adamw"](plain.parameters())
    for x in _batches():
        plain(x[:, :-1], x[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    want = plain.state_dict()
    for state, given_back in run_ranks(_minigpt_ranks, 2):
        assert max((state[k] - want[k]).abs().max().item() for k in want) <= 1e-12
        assert given_back  # cleanup() took the group's attention off


def _refusals(topo):
    import minitrain
    import transformers

    minitrain.init_distributed(topology=topo)
    said = []

    def refused(make, **kwargs):
        said.append(refusal(lambda: minitrain.prepare(make(), OPTIMIZERS["adamw"], **kwargs)))

    def mistral():
        cfg = transformers.MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
        return transformers.MistralForCausalLM(cfg)

    refused(lambda: make_model("gpt2"), cp=2)  # learned positions, no rotary embedding to offset
    refused(mistral, cp=2)
    refused(lambda: make_model("llama"), cp=2, tp=2, tp_plan="auto")
    refused(lambda: make_model("llama"), cp=3)
    refused(lambda: make_model("llama"), cp=2, cp_style="tree")

    def dropout():
        model = make_model("llama")
        model.config.attention_dropout = 0.1
        return model

    refused(dropout, cp=2)
    model, optimizer = minitrain.prepare(make_model("llama"), OPTIMIZERS["adamw"], cp=2)
    x = torch.randint(0, 64, (2, 9))
    mine = minitrain.context_shard(model, x[:, :-1])
    for call in (lambda: minitrain.context_shard(model, x),  # 9 tokens do not cut into 4 chunks
                 lambda: model(input_ids=mine, attention_mask=torch.ones(2, 4, dtype=torch.long).tril()),  # padding
                 lambda: model(input_ids=x[:, :-1]),  # the whole sequences: context_shard forgotten
                 lambda: model(input_ids=mine, labels=mine),  # Hugging Face would shift inside the chunks
                 lambda: model(input_ids=mine, position_ids=torch.arange(4)[None])):
        said.append(refusal(call))
    # The ranks of a group each cut other sequences (x[rank::world] instead of the group's): refused at the step.
    other = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(topo.rank))
    model(input_ids=minitrain.context_shard(model, other[:, :-1])).logits.sum().backward()
    said.append(refusal(optimizer.step))
    minitrain.cleanup()
    return said


REFUSALS = [  # what _refusals' calls are told, in order
    "has none; give a plan naming its position modules", "sliding window",
    "cp=2 with tp=2: context parallelism composes with data parallelism and ZeRO only",
    "cp=3 does not divide the world size 2", "cp_style must be ring or ulysses",
    "attention dropout 0.1 under context parallelism", "does not cut into 2 x cp = 4 equal chunks", "padding mask",
    "given 8 tokens, where context_shard gave 4: under cp each rank gives it its own tokens",
    "labels= makes a Hugging Face model shift the labels", "do not pass position_ids", "were fed different sequences"]


def test_what_context_parallelism_cannot_do_is_refused_saying_why():
    said = run_ranks(_refusals, 2)[0]
    assert len(said) == len(REFUSALS)
    for told, expected in zip(said, REFUSALS):
        assert expected in told, (expected, told)
