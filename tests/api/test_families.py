"""Hugging Face families beyond Llama and GPT-2, from tiny configs (random init, nothing downloaded): an encoder
(BERT, masked LM), an encoder-decoder (T5), a mixture of experts (Mixtral) and GPT-NeoX, with eager attention
and SDPA. Each trains under `minitrain.prepare` at ZeRO 0-3, and at tp=2 and pp=2 where the model's own plan
("auto") applies, equal to plain single-process PyTorch in float64; where it does not apply, the refusal says
why. One launch of 2 ranks runs every case."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import minitrain

from tests.helpers.dist import run_ranks

transformers = pytest.importorskip("transformers")

V, SEQ, STEPS, TOL = 32, 8, 2, 1e-10
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
FAMILIES = ("bert", "t5", "mixtral", "neox")
ATTENTION = ("sdpa", "eager")


def family(name: str, attention: str) -> torch.nn.Module:
    T = transformers
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "bert":
        model = T.BertForMaskedLM(T.BertConfig(
            vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            attn_implementation=attention))
    elif name == "t5":
        model = T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
            decoder_start_token_id=0, attn_implementation=attention))
    elif name == "mixtral":  # eager experts: grouped_mm has no float64 kernel on the CPU
        model = T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=SEQ, num_local_experts=4, num_experts_per_tok=2,
            attn_implementation=attention, experts_implementation="eager"))
    else:
        model = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=SEQ, attention_dropout=0.0, hidden_dropout=0.0, attn_implementation=attention))
    return model.double()


def logits_of(name: str, model, x: torch.Tensor) -> torch.Tensor:
    if name == "t5":  # the decoder reads the same tokens (teacher forcing)
        return model(input_ids=x, decoder_input_ids=x).logits
    return model(input_ids=x).logits


def loss_from_logits(name: str, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if name == "bert":  # reconstruct every token
        return F.cross_entropy(logits.reshape(-1, V), x.reshape(-1))
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (4, SEQ), generator=g) for _ in range(STEPS)]


# (family, attention, zero, tp, pp): what runs; AUTO_REFUSED: what "auto" cannot split, and why.
CASES = ([(f, a, zero, 1, 1) for f in FAMILIES for a in ATTENTION for zero in (range(4) if a == "sdpa" else (3,))]
         + [("neox", a, 1, 2, 1) for a in ATTENTION]
         + [(f, a, 0, 1, 2) for f in ("neox", "mixtral") for a in ATTENTION])
AUTO_REFUSED = {("bert", "tp"): "ships none", ("t5", "tp"): "ships none", ("bert", "pp"): "ships none",
                ("t5", "pp"): "ships none", ("mixtral", "tp"): "packed or expert weights"}


def _run(topo, name, attention, zero, tp, pp):
    model = family(name, attention)
    model, opt = minitrain.prepare(model, ADAMW, zero=zero, tp=tp, tp_plan="auto" if tp > 1 else None, pp=pp,
                                   pp_split="auto" if pp > 1 else None)
    losses = []
    for x in batches():
        mine = x.chunk(minitrain.dp_world_size())[minitrain.dp_rank()]
        if pp > 1:
            loss = minitrain.pipeline_step(model, mine, mine, functools.partial(loss_from_logits, name))
        else:
            loss = loss_from_logits(name, logits_of(name, model, mine), mine)
            loss.backward()
            loss = loss.item()
        minitrain.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        total = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total) / topo.world_size)
    return losses, minitrain.full_state_dict(model)


def _refusals():
    out = {}
    for (name, kind), _ in AUTO_REFUSED.items():
        model = family(name, "sdpa")
        try:
            minitrain.prepare(model, ADAMW, **({"tp": 2, "tp_plan": "auto"} if kind == "tp" else
                                               {"pp": 2, "pp_split": "auto"}))
            out[(name, kind)] = "accepted"
        except ValueError as e:
            out[(name, kind)] = str(e)
    return out


def _all_cases(topo):
    minitrain.init_distributed(topology=topo)
    return {case: _run(topo, *case) for case in CASES}, _refusals()


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_all_cases, 2, timeout_s=240)


def reference(name: str, attention: str) -> tuple[list[float], dict]:
    model = family(name, attention)
    opt = ADAMW(model.parameters())
    losses = []
    for x in batches():
        loss = loss_from_logits(name, logits_of(name, model, x), x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_trains_like_plain_pytorch_at_every_layout_that_applies(two_ranks, name):
    results = two_ranks[0][0]
    assert sum(case[0] == name for case in results) == sum(case[0] == name for case in CASES) > 0
    for attention in ATTENTION:
        ref_losses, ref_state = reference(name, attention)
        for case, (losses, state) in results.items():
            if case[:2] != (name, attention):
                continue
            where = f"{name} {attention} ZeRO-{case[2]} tp={case[3]} pp={case[4]}"
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, where
            assert list(state) == list(ref_state), where
            for key, value in ref_state.items():
                assert (state[key] - value).abs().max().item() <= TOL, f"{where}: {key}"


def test_where_the_models_own_plan_does_not_apply_the_refusal_says_why(two_ranks):
    for rank_out in two_ranks:
        for key, reason in AUTO_REFUSED.items():
            assert reason in rank_out[1][key], (key, rank_out[1][key])
