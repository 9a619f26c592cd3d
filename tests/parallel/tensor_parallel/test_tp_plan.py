"""Tensor parallelism for a model minitrain did not write, through a plan of module-name patterns: a tiny
Hugging Face Llama (grouped-query attention, rotary) with its own plan (tp_plan="auto") trains under
`minitrain.prepare(tp=2)` like plain PyTorch in one process (float64, 1e-10), a sharded layer's gradients are
the unsharded layer's, and every refusal names what to change."""
import functools

import pytest
import torch
import torch.distributed as dist

import minitrain
from minitrain.checkpoint import consolidated_state_dict
from minitrain.runtime.comm import Comm
from minitrain.parallel.recompute import apply_activation_checkpointing, targets
from minitrain.parallel.state.slices import tensor_parallel_slices
from minitrain.parallel.tensor_parallel.plans import (
    Colwise,
    apply_tensor_parallel,
    check_heads,
    hugging_face_plan,
    matches,
    resolve,
)

from tests.helpers.dist import run_ranks
from tests.helpers.hf_models import SEQ, VOCAB, batches, lm_loss, make_model, param_groups

transformers = pytest.importorskip("transformers")

STEPS, MAX_NORM, TOL = 4, 0.5, 1e-10
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95))


def llama(tied: bool = False, kv_heads: int = 2, layers: int = 2) -> torch.nn.Module:
    """4 query heads sharing 2 key-value heads, so tp=2 keeps whole groups on each rank."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
                                   tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=5)  # a padding row: it gets no gradient, split or not
    model = transformers.LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.data = p.data.double()
    return model


def reference(tied: bool, layers: int = 2) -> dict:
    model = llama(tied, layers=layers)
    opt = ADAMW(param_groups(model))
    losses = []
    for x in batches(STEPS, 8):
        loss = lm_loss(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# (tied, ZeRO stage, activation checkpointing) at tp=2 x dp=2 on 4 ranks.
CASES = [(False, 1, "none"), (True, 3, "model.layers.*"), (False, 0, "none")]


def _train(topo, root, tied, zero, ac):
    model = llama(tied)
    model, opt = minitrain.prepare(model, ADAMW, zero=zero, param_groups=param_groups(model), tp=2, tp_plan="auto",
                                   activation_checkpointing=ac)
    assert (minitrain.dp_rank(), minitrain.dp_world_size()) == (topo.rank // 2, 2)  # tp innermost
    losses = []
    for x in batches(STEPS, 8):
        mine = x.chunk(minitrain.dp_world_size())[minitrain.dp_rank()]  # a tensor-parallel pair feeds the same
        loss = lm_loss(model, mine)
        loss.backward()
        minitrain.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total) / topo.world_size)
    still_tied = model.lm_head.weight is model.model.embed_tokens.weight
    path = minitrain.save_checkpoint(root / f"{tied}-{zero}", model, opt, STEPS)
    return {"losses": losses, "tied": still_tied, "checkpoint": str(path),
            "head_width": model.lm_head.weight.shape[0]}


def _sharded_gradients(topo):
    """A tensor-parallel Llama against the whole one on the same batch: the largest difference between a
    sharded parameter's gradient and the matching rows/columns of the whole one's (and between replicated
    ones' gradients), and between the logits."""
    layout = topo.with_layout(2, 1)
    whole, sharded = llama(), llama()
    apply_tensor_parallel(sharded, hugging_face_plan(sharded), layout.tp)
    x = batches(1, 4)[0]
    x[0, :2] = 5  # the padding token, whose embedding row must get no gradient on the rank holding it
    logits_whole, logits_sharded = whole(input_ids=x).logits, sharded(input_ids=x).logits
    lm_loss(whole, x).backward()
    lm_loss(sharded, x).backward()
    slices = tensor_parallel_slices(sharded)
    grads_whole = dict(whole.named_parameters())
    worst = 0.0
    for name, p in sharded.named_parameters():
        expected = grads_whole[name].grad
        if name in slices:
            expected = expected.index_select(slices[name].dim, slices[name].index)
        worst = max(worst, (p.grad - expected).abs().max().item())
    return {"grad": worst, "logits": (logits_whole - logits_sharded).abs().max().item(), "sliced": sorted(slices)}


def next_token_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """lm_loss's cross-entropy, from a pipeline's last stage: logits of a micro-batch and its tokens."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


# (tp, pp, ZeRO stage, schedule, micro-batches) on 4 ranks; a 4-layer untied Llama, pp_split="auto".
PIPELINES = [(1, 2, 1, "gpipe", 2), (1, 2, 3, "1f1b", 4), (2, 2, 1, "1f1b", 2), (2, 2, 3, "gpipe", 4)]


def _pipelined(topo, root, tp, pp, zero, schedule, microbatches):
    model = llama(layers=4)
    model, opt = minitrain.prepare(model, ADAMW, zero=zero, param_groups=param_groups(model), tp=tp,
                                   tp_plan="auto" if tp > 1 else None, pp=pp, pp_split="auto",
                                   microbatches=microbatches, schedule=schedule)
    assert minitrain.dp_world_size() == topo.world_size // (tp * pp)
    losses = []
    for x in batches(STEPS, 8):
        mine = x.chunk(minitrain.dp_world_size())[minitrain.dp_rank()]
        loss = minitrain.pipeline_step(model, mine, mine, next_token_loss)  # in place of forward + backward
        minitrain.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        total = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(total)  # a pipeline's ranks all return their replica's loss
        losses.append(float(total) / topo.world_size)
    path = minitrain.save_checkpoint(root / f"pp-{tp}-{pp}-{zero}-{schedule}", model, opt, STEPS)
    return {"losses": losses, "checkpoint": str(path),
            "layers": sorted(model.model.layers.keys()) if model.model.layers is not None else []}


def _four_ranks(topo, root):
    minitrain.init_distributed(topology=topo)
    trained = {case: _train(topo, root, *case) for case in CASES}
    pipelined = {case: _pipelined(topo, root, *case) for case in PIPELINES}
    return trained, _sharded_gradients(topo), pipelined


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return run_ranks(_four_ranks, 4, root, timeout_s=240)


def test_llama_with_its_own_plan_trains_like_one_plain_process(four_ranks):
    for tied in (False, True):
        ref = reference(tied)
        for (case_tied, zero, ac), got in four_ranks[0][0].items():
            if case_tied != tied:
                continue
            where = f"tied={tied} ZeRO-{zero} ac={ac}"
            assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= TOL, where
            state = consolidated_state_dict(got["checkpoint"])  # the whole model's keys, from the tp x dp shards
            assert state.keys() == ref["state"].keys(), where
            for key, value in ref["state"].items():
                assert (state[key] - value).abs().max().item() <= TOL, f"{where}: {key}"
            assert got["tied"] == tied and got["head_width"] == VOCAB // 2, where  # the tie held, the head is split


def test_a_sharded_llama_has_the_whole_ones_logits_and_gradients(four_ranks):
    for rank, (_, got, _) in enumerate(four_ranks):
        assert got["logits"] <= 1e-12 and got["grad"] <= 1e-12, (rank, got)
        assert "model.layers.0.self_attn.k_proj.weight" in got["sliced"]  # the key-value heads were split too
        assert "model.embed_tokens.weight" in got["sliced"]  # and the embedding, padding row included


def test_llama_pipelined_and_tensor_parallel_trains_like_one_plain_process(four_ranks):
    """pp 2 x dp 2 and pp 2 x tp 2 at ZeRO 1 and 3, GPipe and 1F1B, the user's loop with pipeline_step."""
    ref = reference(False, layers=4)
    for (tp, pp, zero, schedule, micro), got in four_ranks[0][2].items():
        where = f"tp {tp} x pp {pp}, ZeRO-{zero}, {schedule} x {micro}"
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= TOL, where
        state = consolidated_state_dict(got["checkpoint"])
        assert state.keys() == ref["state"].keys(), where
        for key, value in ref["state"].items():
            assert (state[key] - value).abs().max().item() <= TOL, f"{where}: {key}"
    stages = [got["layers"] for _, _, pipelined in four_ranks for got in pipelined.values()]
    assert ["0", "1"] in stages and ["2", "3"] in stages  # each stage kept its blocks under their own names


def test_pipeline_splits_are_checked_before_any_rank_splits():
    from minitrain.parallel.pipeline_parallel.split import PipelineSplit, check_split, cross_stage_ties

    model = llama(layers=4)
    auto = PipelineSplit.auto(model)
    assert auto.pieces == ["model.embed_tokens", "model.layers", "model.norm", "lm_head"] and auto.block_kwargs
    for pieces, match in ((["model.embed", "model.layers", "model.norm", "lm_head"], "'model.embed', which is not"),
                          (["model.embed_tokens", "model.norm", "lm_head"], "exactly one piece"),
                          (["model.embed_tokens", "model.layers", "lm_head"], "'model.norm.weight' is in no piece")):
        with pytest.raises(ValueError, match=match):
            check_split(model, PipelineSplit(pieces), 2)
    with pytest.raises(ValueError, match="pp=5 needs at least one block per stage"):
        check_split(model, auto, 5)
    assert cross_stage_ties(llama(tied=True, layers=4), auto, 2) == ["model.embed_tokens.weight and lm_head.weight"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel ships none"):
        PipelineSplit.auto(make_model("gpt2"))
    with pytest.raises(ValueError, match="pp_split is given but pp=1"):
        minitrain.prepare(llama(), ADAMW, pp_split="auto")
    with pytest.raises(ValueError, match="tp x pp = 1 x 2 does not divide the world size 1"):
        minitrain.prepare(llama(), ADAMW, pp=2, pp_split="auto")  # one process
    with pytest.raises(ValueError, match="pipeline_step is for a model prepared with pp > 1"):
        plain, _ = minitrain.prepare(llama(), ADAMW)
        minitrain.pipeline_step(plain, batches(1, 2)[0], batches(1, 2)[0], next_token_loss)


def test_patterns_match_segment_by_segment():
    assert matches("layers.*.mlp", "layers.3.mlp")
    assert not matches("layers.*.mlp", "layers.3.attn.mlp") and not matches("layers.*", "layers")
    model = llama()
    assert sorted(resolve(model, {"model.layers.*.mlp.*_proj": "colwise"})) == [
        f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("down", "gate", "up")]


def test_the_auto_plan_is_the_models_own():
    plan = hugging_face_plan(llama())
    assert plan["model.layers.*.self_attn.k_proj"] == "colwise" and plan["lm_head"] == "colwise_gather_output"
    assert plan["model.embed_tokens"] == "embedding_rowwise"  # Hugging Face's name for a vocabulary split
    tied = llama(tied=True)
    assert hugging_face_plan(tied)["model.embed_tokens"] in ("embedding_rowwise", "vocab_embedding")
    del tied._tp_plan["model.embed_tokens"]
    assert hugging_face_plan(tied)["model.embed_tokens"] == "vocab_embedding"  # split alike, so the tie holds


def _refusal(model, plan, match, degree=2):
    with pytest.raises(ValueError, match=match) as info:
        apply_tensor_parallel(model, plan, Comm(rank=0, world_size=degree))  # refused before any collective
    assert "\n" not in str(info.value)


def test_every_refusal_names_what_to_change():
    _refusal(llama(), {"model.layers.*.attn.q_proj": "colwise"}, "matches no module of LlamaForCausalLM")
    _refusal(llama(), {"lm_head": "diagonal"}, "not a style minitrain knows")
    _refusal(llama(), {"model.layers.*.mlp.up_proj": "colwise", "model.layers.0.mlp.*": "rowwise"},
             "matched by tp_plan patterns")
    _refusal(llama(), {"model.embed_tokens": "colwise"}, "applies to nn.Linear; 'model.embed_tokens' is a Embedding")
    _refusal(llama(), {"model.layers.*.self_attn.q_proj": "vocab_embedding"}, "applies to nn.Embedding")
    _refusal(torch.nn.Sequential(torch.nn.Linear(6, 8)), {"0": "rowwise"}, "tp=4 does not divide the 6 input "
             "features of '0'", degree=4)
    _refusal(torch.nn.Sequential(torch.nn.Linear(6, 9)), {"0": Colwise(parts=3)}, "the 3 output features per part",
             degree=2)
    _refusal(llama(kv_heads=1), hugging_face_plan(llama(kv_heads=1)), r"does not divide LlamaForCausalLM's 1 "
             r"key-value heads \(grouped-query attention\)")
    _refusal(llama(tied=True), {"lm_head": "colwise_gather_output"}, "share one tied weight, but the tp_plan splits")
    _refusal(make_model("gpt2"), {"transformer.h.*.attn.c_attn": "colwise"}, "Conv1D .* stores its weight transposed")
    with pytest.raises(ValueError, match="GPT2LMHeadModel ships none"):
        hugging_face_plan(make_model("gpt2"))
    with pytest.raises(ValueError, match="does not divide LlamaForCausalLM's 4 attention heads"):
        check_heads(llama(), 3)
    with pytest.raises(ValueError, match="tp x pp = 2 x 1 does not divide the world size 1"):
        minitrain.prepare(llama(), ADAMW, tp=2, tp_plan="auto")  # one process
    with pytest.raises(ValueError, match="tp_plan is given but tp=1"):
        minitrain.prepare(llama(), ADAMW, tp_plan="auto")


def test_activation_checkpointing_by_pattern_or_class_recomputes_exactly_those_modules():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    x = batches(1, 4)[0]
    plain = llama()
    lm_loss(plain, x).backward()
    for which in ("model.layers.*", LlamaDecoderLayer):
        model = llama()
        assert targets(model, which) == list(model.model.layers)
        apply_activation_checkpointing(model, which)
        lm_loss(model, x).backward()
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), (which, name)
    with pytest.raises(ValueError, match="pattern 'layers.*' matches no module"):
        apply_activation_checkpointing(llama(), "layers.*")
