"""The whole state of a prepared model and its optimizer, under every layout: the placement rule
(parallel/state/placement.py) for frozen, tied and sliced tensors, `full_state_dict` across tensor-parallel slices and
pipeline stages, and the optimizer's whole state (param-group options in checkpoints, torch-format
state_dict/load_state_dict, 0-dim parameters), each against plain single-process PyTorch in float64.

The multi-rank cases share one launch of 2 ranks, so the interpreter and transformers start once."""
from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import minitrain
from minitrain.checkpoint import CheckpointError
from minitrain.apps.ckpt import consolidate
from minitrain.checkpoint import consolidated_state_dict

from tests.helpers.dist import run_ranks
from tests.helpers.hf_models import SEQ, VOCAB, batches, lm_loss

transformers = pytest.importorskip("transformers")

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
TOL = 1e-12


def llama(frozen_embedding: bool = False, tied: bool = False, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).double()
    if frozen_embedding:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def plain(build, steps: list[torch.Tensor], optimizer=ADAMW) -> tuple[dict, torch.optim.Optimizer, list[float]]:
    """Plain PyTorch in one process on the whole global batch: final state_dict, the optimizer, the losses."""
    model = build()
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for x in steps:
        loss = lm_loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt, losses


def _train(model, opt, steps):
    losses = []
    for x in steps:
        mine = x.chunk(minitrain.dp_world_size())[minitrain.dp_rank()]
        loss = lm_loss(model, mine)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def _pipe_step(model, opt, x, loss_fn):
    loss = minitrain.pipeline_step(model, x, x, loss_fn)
    opt.step()
    opt.zero_grad()
    return loss


def _two_ranks(topo, root):
    minitrain.init_distributed(topology=topo)
    out = {}
    steps = batches(3, 4)
    # 1. A frozen embedding split over the vocabulary at tp=2: saved whole, consolidated whole, each rank's own
    #    slice back on a same-layout resume.
    model = llama(frozen_embedding=True)
    model, opt = minitrain.prepare(model, ADAMW, zero=1, tp=2, tp_plan={"model.embed_tokens": "vocab_embedding",
                                                                         "lm_head": "colwise_gather_output"})
    out["tp_losses"] = _train(model, opt, steps[:2])
    out["tp_state"] = minitrain.full_state_dict(model)
    saved = minitrain.save_checkpoint(root / "tp", model, opt, 2)
    again = llama(frozen_embedding=True, seed=5)
    again, opt2 = minitrain.prepare(again, ADAMW, zero=1, tp=2, tp_plan={"model.embed_tokens": "vocab_embedding",
                                                                         "lm_head": "colwise_gather_output"})
    minitrain.load_checkpoint(saved, again, opt2)
    out["tp_resumed"] = _train(again, opt2, steps[2:])
    out["tp_uninterrupted"] = _train(model, opt, steps[2:])
    # 2. A pipeline of two stages at ZeRO-0 (it raised KeyError): the whole state_dict on every rank.
    model = llama()
    model, opt = minitrain.prepare(model, ADAMW, zero=0, pp=2, pp_split="auto")
    out["pp_losses"] = [_pipe_step(model, opt, x, _next_token) for x in steps]
    out["pp_state"] = minitrain.full_state_dict(model)
    out["pp_optimizer"] = opt.state_dict()
    # 3. The optimizer's state_dict at every ZeRO stage equals plain torch's; a frozen tied embedding saves and
    #    loads at every stage.
    for zero in range(4):
        model = llama()
        model, opt = minitrain.prepare(model, ADAMW, zero=zero)
        _train(model, opt, steps[:2])
        out[f"optimizer-{zero}"] = opt.state_dict()
        tied = llama(frozen_embedding=True, tied=True)
        tied, tied_opt = minitrain.prepare(tied, ADAMW, zero=zero)
        _train(tied, tied_opt, steps[:1])
        path = minitrain.save_checkpoint(root / f"tied-{zero}", tied, tied_opt, 1)
        back = llama(frozen_embedding=True, tied=True, seed=3)
        back, back_opt = minitrain.prepare(back, ADAMW, zero=zero)
        minitrain.load_checkpoint(path, back, back_opt)
        assert back.lm_head.weight is back.model.embed_tokens.weight, "the frozen tie must hold after a load"
        out[f"tied-{zero}"] = (minitrain.full_state_dict(tied), minitrain.full_state_dict(back))
    # 4. model.load_state_dict after prepare, as users load weights: the next step starts from them at every stage.
    new_weights = llama(seed=7).state_dict()
    for zero in range(4):
        model, opt = minitrain.prepare(llama(), ADAMW, zero=zero)
        _train(model, opt, steps[:1])
        model.load_state_dict(new_weights)
        _train(model, opt, steps[1:2])
        out[f"loaded-{zero}"] = minitrain.full_state_dict(model)
        try:
            model.state_dict()
            out[f"state_dict-{zero}"] = "given"
        except RuntimeError as e:
            out[f"state_dict-{zero}"] = str(e)
    return out


def _next_token(logits, x):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    return run_ranks(_two_ranks, 2, root, timeout_s=240), root


def _close(a: dict, b: dict, where: str, tol: float = TOL) -> None:
    assert list(a) == list(b), where
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, f"{where}: {key}"
        assert (a[key] - b[key]).abs().max().item() <= tol, f"{where}: {key}"


def test_a_frozen_tensor_parallel_embedding_is_saved_consolidated_and_resumed_whole(two_ranks, tmp_path):
    (rank0, rank1), root = two_ranks
    ref_state, _, ref_losses = plain(lambda: llama(frozen_embedding=True), batches(3, 4)[:2])
    assert max(abs(a - b) for a, b in zip(rank0["tp_losses"], ref_losses)) <= 1e-10
    for got in (rank0["tp_state"], rank1["tp_state"]):  # every rank: the whole model, (vocab, d) embedding
        _close(got, ref_state, "tp=2 full_state_dict", 1e-10)
    consolidated = consolidated_state_dict(str(root / "tp"))
    _close(consolidated, rank0["tp_state"], "consolidated at tp=2", 0.0)
    assert rank0["tp_resumed"] == rank0["tp_uninterrupted"]  # each tp rank got its own slice back: bit for bit


def test_full_state_dict_of_a_pipeline_holds_every_stage(two_ranks):
    (rank0, rank1), _ = two_ranks
    ref_state, ref_opt, ref_losses = plain(llama, batches(3, 4))
    assert max(abs(a - b) for a, b in zip(rank0["pp_losses"], ref_losses)) <= 1e-10
    for got in (rank0, rank1):
        _close(got["pp_state"], ref_state, "pp=2 full_state_dict", 1e-10)
        _close_optimizer(got["pp_optimizer"], ref_opt.state_dict(), "pp=2 optimizer", 1e-10)


def _close_optimizer(got: dict, ref: dict, where: str, tol: float = TOL) -> None:
    assert got["param_groups"] == ref["param_groups"], where
    assert got["state"].keys() == ref["state"].keys(), where
    for i, entry in ref["state"].items():
        assert got["state"][i].keys() == entry.keys(), f"{where}: {i}"
        for name, value in entry.items():
            mine = got["state"][i][name]
            assert type(mine) is type(value) and mine.shape == value.shape and mine.dtype == value.dtype, \
                f"{where}: state {i} {name}"
            assert (mine - value).abs().max().item() <= tol, f"{where}: state {i} {name}"


def test_the_optimizer_state_dict_is_plain_torchs_at_every_stage(two_ranks):
    (rank0, rank1), _ = two_ranks
    _, ref_opt, _ = plain(llama, batches(3, 4)[:2])
    for zero in range(4):
        for got in (rank0, rank1):
            _close_optimizer(got[f"optimizer-{zero}"], ref_opt.state_dict(), f"ZeRO-{zero}")


def test_a_frozen_tied_embedding_saves_and_loads_tied_at_every_stage(two_ranks):
    (rank0, _), root = two_ranks
    for zero in range(4):
        saved, loaded = rank0[f"tied-{zero}"]
        _close(loaded, saved, f"tied frozen ZeRO-{zero}", 0.0)
        manifest = json.loads((root / f"tied-{zero}" / "step-000001" / "manifest.json").read_text())
        stored = [t["key"] for t in manifest["tensors"] if t["key"].startswith("model.")]
        assert stored.count("model.model.embed_tokens.weight") == 1 and "model.lm_head.weight" not in stored


def test_loading_weights_into_a_prepared_model_takes_effect_at_every_stage(two_ranks):
    """model.load_state_dict after prepare: ZeRO-2 used to step from its old master copy (the loaded weights were
    silently undone), ZeRO-3 wrote into freed shards. model.state_dict() at ZeRO-3 is refused, naming the call that
    gathers."""
    (rank0, rank1), _ = two_ranks
    model = llama()
    opt = ADAMW([p for p in model.parameters() if p.requires_grad])
    for i, x in enumerate(batches(3, 4)[:2]):
        if i == 1:
            model.load_state_dict(llama(seed=7).state_dict())
        lm_loss(model, x).backward()
        opt.step()
        opt.zero_grad()
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for zero in range(4):
        for got in (rank0, rank1):
            _close(got[f"loaded-{zero}"], ref, f"load_state_dict at ZeRO-{zero}", 1e-10)
        expected = "minitrain.full_state_dict" if zero == 3 else "given"
        assert expected in rank0[f"state_dict-{zero}"], zero


# --- one process ---------------------------------------------------------------------------------------------
def test_a_scheduler_resumes_at_its_learning_rate_and_the_state_dict_round_trips(tmp_path):
    """LambdaLR's learning rate lives in the optimizer's param groups: saved by save_checkpoint and restored by
    load_checkpoint (it was lost: the first step after a resume ran at the base lr), and through the optimizer's
    own state_dict()/load_state_dict(), which now work as torch's do."""
    def warmup(step):
        return min(1.0, (step + 1) / 4)

    steps = batches(5, 4)

    def run(resume_at: int | None, via: str):
        model, opt = minitrain.prepare(llama(), ADAMW, zero=1)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        losses = []
        for i, x in enumerate(steps):
            if i == resume_at:
                saved_schedule = schedule.state_dict()
                if via == "checkpoint":
                    minitrain.save_checkpoint(tmp_path / "ckpt", model, opt, i)
                else:
                    saved_opt, saved_model = opt.state_dict(), minitrain.full_state_dict(model)
                model, opt = minitrain.prepare(llama(seed=4), ADAMW, zero=1)
                schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup)  # a fresh run builds its own
                if via == "checkpoint":
                    minitrain.load_checkpoint(tmp_path / "ckpt", model, opt)
                else:
                    model.load_state_dict(saved_model)
                    opt.load_state_dict(saved_opt)
                schedule.load_state_dict(saved_schedule)
            losses.append(lm_loss(model, x))
            losses[-1].backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
            losses[-1] = losses[-1].item()
        return losses, [g["lr"] for g in opt.param_groups], minitrain.full_state_dict(model)

    straight = run(None, "")
    for via in ("checkpoint", "state_dict"):
        resumed = run(2, via)
        assert resumed[0] == straight[0] and resumed[1] == straight[1], via
        _close(resumed[2], straight[2], via, 0.0)


class WithScalar(torch.nn.Module):
    """A learnable 0-dim temperature beside a matrix."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
        self.temperature = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x):
        return (x @ self.weight) / self.temperature


def test_a_0_dim_parameter_keeps_tensor_state_through_a_checkpoint(tmp_path):
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def step(model, opt):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = minitrain.prepare(WithScalar(), ADAMW, zero=0)
    step(model, opt)
    minitrain.save_checkpoint(tmp_path, model, opt, 1)
    step(model, opt)
    again, again_opt = minitrain.prepare(WithScalar(), ADAMW, zero=0)
    minitrain.load_checkpoint(tmp_path, again, again_opt)
    step(again, again_opt)  # failed: the 0-dim state came back as a Python number
    _close(minitrain.full_state_dict(again), minitrain.full_state_dict(model), "0-dim", 0.0)
    ref = WithScalar()
    ref_opt = ADAMW(list(ref.parameters()))
    for _ in range(2):
        step(ref, ref_opt)
    _close_optimizer(again_opt.state_dict(), ref_opt.state_dict(), "0-dim optimizer")


def test_a_checkpoint_of_another_model_is_refused_naming_the_key(tmp_path):
    model, opt = minitrain.prepare(llama(frozen_embedding=True), ADAMW, zero=0)
    minitrain.save_checkpoint(tmp_path, model, opt, 1)
    other = llama(frozen_embedding=True)
    other.model.embed_tokens.weight.data = other.model.embed_tokens.weight.data.float()
    other, other_opt = minitrain.prepare(other, ADAMW, zero=0)
    with pytest.raises(CheckpointError, match="'model.embed_tokens.weight' is \\[64, 16\\] float64 there"):
        minitrain.load_checkpoint(tmp_path, other, other_opt)
    more = llama(frozen_embedding=True)
    more.register_buffer("step_count", torch.zeros((), dtype=torch.float64))
    more, more_opt = minitrain.prepare(more, ADAMW, zero=0)
    minitrain.save_checkpoint(tmp_path / "more", more, more_opt, 1)
    fewer, fewer_opt = minitrain.prepare(llama(frozen_embedding=True), ADAMW, zero=0)
    with pytest.raises(CheckpointError, match="holds 'step_count', which this model's state_dict has not"):
        minitrain.load_checkpoint(tmp_path / "more", fewer, fewer_opt)
    out = tmp_path / "out"
    out.mkdir()
    consolidate(str(tmp_path), str(out / "model.safetensors"))
    assert sorted(load_file(str(out / "model.safetensors"))) == sorted(llama().state_dict())
