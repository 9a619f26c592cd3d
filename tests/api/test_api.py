"""The public API on models the project did not write: tiny Hugging Face Llama (tied and untied) and GPT-2,
the user's own torch optimizer and loop, against plain single-process PyTorch (tests/helpers/hf_models.py), in float64.

Each multi-rank test is one launch that runs many cases, so the interpreter and transformers start once."""
from __future__ import annotations

import functools
from pathlib import Path
import time

import pytest
import torch
import torch.distributed as dist

import minitrain
from minitrain.checkpoint import CheckpointError
from minitrain.parallel.core.shard_optimizer import NotElementwiseError

from tests.helpers.dist import run_ranks
from tests.helpers.hf_models import (KINDS, OPTIMIZERS, batches, frozen_parameter, lm_loss, make_model, param_groups,
                                     reference_run, tied)

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

STEPS, MAX_NORM, TOL = 4, 0.5, 1e-10


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _train(kind, optimizer, zero, steps, rank, world, micro=1):
    """The user's loop on this rank's share of each global batch. Returns losses, norms, model, optimizer."""
    model = make_model(kind)
    frozen_before = frozen_parameter(model).detach().clone()
    buffers_before = {n: (b.dtype, b.device, b.clone()) for n, b in model.named_buffers()}
    model, opt = minitrain.prepare(model, OPTIMIZERS[optimizer], zero=zero, param_groups=param_groups(model))
    strategy = minitrain.api.session.state_of(model).strategy
    losses, norms = [], []
    for step, x in enumerate(steps):
        mine = x.chunk(world)[rank].chunk(micro)
        total = 0.0
        for i, part in enumerate(mine):
            with minitrain.no_sync(model) if i < micro - 1 else _nothing():
                loss = lm_loss(model, part) / micro
                loss.backward()
            total += loss.item()
        if zero >= 2 and step > 0:  # the shard zero_grad gave back: each unit's reduction allocated its piece again
            assert strategy.memory_bytes()["grads"] == strategy.expected_memory_bytes()["grads"]
        norms.append(minitrain.clip_grad_norm_(model, MAX_NORM))
        opt.step()
        after_step = strategy.memory_bytes()
        opt.zero_grad()
        losses.append(_global_mean(total))
    # Memory at rest after a step, measured from the tensors' storages, equals the math: params, grads, and the
    # optimizer's state (m and v, or SGD's momentum) sharded by the stage; no master copy of full-precision
    # parameters at ZeRO 0, 1 and 3. zero_grad() (set_to_none, torch's default) then gives back ZeRO-2/3's
    # gradient shard, as FSDP2 frees its sharded gradients.
    assert after_step == strategy.expected_memory_bytes(), (kind, optimizer, zero)
    assert strategy.memory_bytes()["grads"] == (0 if zero >= 2 else after_step["grads"])
    assert strategy.master_is_params == (zero != 2)
    frozen = frozen_parameter(model)
    assert torch.equal(frozen, frozen_before) and frozen.grad is None  # never changes, no gradient buffer
    assert all(p is not frozen for group in opt.param_groups for p in group["params"])  # no optimizer state
    for name, b in model.named_buffers():
        dtype, device, value = buffers_before[name]
        assert b.dtype == dtype and b.device == device and torch.equal(b, value), name
    return losses, norms, model, opt


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _parity_cases(topo, cases, micro):
    minitrain.init_distributed(topology=topo)
    steps = batches(STEPS, 8)
    out = {}
    for kind, optimizer, zero in cases:
        losses, norms, model, _ = _train(kind, optimizer, zero, steps, topo.rank, topo.world_size, micro)
        if kind == "llama-tied":
            assert tied(model), "the tied head must stay the embedding"
        out[(kind, optimizer, zero)] = {"losses": losses, "norms": norms, "state": minitrain.full_state_dict(model)}
    return out


def _check_against_reference(results):
    references = {}
    for (kind, optimizer, zero), got in results.items():
        ref = references.setdefault((kind, optimizer), reference_run(kind, optimizer, batches(STEPS, 8), MAX_NORM))
        where = f"{kind} {optimizer} ZeRO-{zero}"
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= TOL, where
        assert max(abs(a - b) for a, b in zip(got["norms"], ref["norms"])) <= TOL, where
        assert min(ref["norms"]) > MAX_NORM, "clipping must engage at every step"
        assert got["state"].keys() == ref["state"].keys(), where
        for key, value in ref["state"].items():
            assert (got["state"][key] - value).abs().max().item() <= TOL, f"{where}: {key}"


@pytest.mark.parametrize("world", [2, 4])
def test_hugging_face_models_train_like_plain_pytorch_at_every_zero_stage(world):
    """Llama (tied and untied) and GPT-2, AdamW and SGD with momentum, two param groups (no decay for biases
    and norms), a frozen parameter, clipping every step: losses, norms and final parameters equal plain
    PyTorch on the whole global batch to 1e-10 at ZeRO 0-3."""
    cases = [(kind, opt, zero) for kind in KINDS for opt in OPTIMIZERS for zero in range(4)]
    if world == 4:  # every stage and model again at 4 ranks; SGD's path is the same code as AdamW's
        cases = [(kind, "adamw", zero) for kind in KINDS for zero in range(4)]
    _check_against_reference(run_ranks(_parity_cases, world, cases, 1, timeout_s=240)[0])


def test_accumulation_under_no_sync_equals_one_big_batch_at_every_stage():
    cases = [("llama-tied", "adamw", zero) for zero in range(4)]
    _check_against_reference(run_ranks(_parity_cases, 2, cases, 2, timeout_s=120)[0])


# --- checkpoints -------------------------------------------------------------------------------------
def _save_then_continue(topo, root, kind, zero):
    """Steps 1-5, save at 5, steps 6-10; returns the states after each step 6..10."""
    minitrain.init_distributed(topology=topo)
    steps = batches(10, 8)
    _, _, model, opt = _train(kind, "adamw", zero, steps[:5], topo.rank, topo.world_size)
    minitrain.save_checkpoint(root, model, opt, 5, extra={"epoch": 0, "note": "after five"})
    return _continue(model, opt, steps[5:], topo)


def _continue(model, opt, steps, topo):
    states = []
    for x in steps:
        part = x.chunk(topo.world_size)[topo.rank]
        lm_loss(model, part).backward()
        minitrain.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        states.append(minitrain.full_state_dict(model))
    return states


def _resume(topo, root, kind, zero):
    minitrain.init_distributed(topology=topo)
    model = make_model(kind, seed=123)  # different initial weights: all must come from the checkpoint
    model, opt = minitrain.prepare(model, OPTIMIZERS["adamw"], zero=zero, param_groups=param_groups(model))
    step, extra = minitrain.load_checkpoint(root, model, opt)
    assert (step, extra) == (5, {"epoch": 0, "note": "after five"})
    if kind == "llama-tied":
        assert tied(model)
    return _continue(model, opt, batches(10, 8)[5:], topo), _elements_read(model, root)


def _elements_read(model, root) -> tuple[int, int, int]:
    """(parameter elements this rank's load read, elements in its shard, elements in the model)."""
    from minitrain import checkpoint

    strategy = minitrain.api.session.state_of(model).strategy
    manifest = checkpoint.read_manifest(checkpoint.resolve(root))
    wanted = strategy.flat.pieces(strategy.shard_ranges)
    read = sum(n for copies in checkpoint.plan_reads(manifest, "params", wanted).values() for _, _, n in copies)
    return read, sum(b - a for a, b in strategy.shard_ranges), strategy.flat.logical_numel


def test_resume_is_bit_identical_reshards_and_reads_only_a_ranks_pieces(tmp_path):
    root = tmp_path / "ckpt"
    uninterrupted = run_ranks(_save_then_continue, 2, str(root), "llama-tied", 1)[0]
    same = run_ranks(_resume, 2, str(root), "llama-tied", 1)[0][0]
    assert (root / "latest").read_text().strip() == "step-000005"
    assert sorted(p.name for p in (root / "step-000005").iterdir()) == [
        "manifest.json", "manifest.sha256", "rank-00000.safetensors", "rank-00001.safetensors"]
    for a, b in zip(uninterrupted, same):  # fresh processes, same layout: bit for bit
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for world, zero in ((4, 3), (1, 0)):
        ranks = run_ranks(_resume, world, str(root), "llama-tied", zero)
        for a, b in zip(uninterrupted, ranks[0][0]):
            assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-12, (world, zero)
        if zero == 3:  # each rank read only its own shard's elements; together, every element once
            reads = [r[1] for r in ranks]
            assert sum(read for read, _, _ in reads) == reads[0][2]
            assert all(read <= shard < whole for read, shard, whole in reads)


def _save_on_rank0_only(topo, root):
    minitrain.init_distributed(timeout_s=2, topology=topo)
    model = make_model("gpt2")
    model, opt = minitrain.prepare(model, OPTIMIZERS["sgd"], zero=2)
    if topo.rank != 0:
        time.sleep(4)  # busy elsewhere, as a rank that skipped the call would be
        return "skipped"
    start = time.perf_counter()
    try:
        minitrain.save_checkpoint(root, model, opt, 1)
    except CheckpointError as e:
        return str(e), time.perf_counter() - start
    return "saved", 0.0


def test_a_save_called_on_one_rank_fails_fast_naming_the_missing_ranks(tmp_path):
    message, seconds = run_ranks(_save_on_rank0_only, 4, str(tmp_path / "ckpt"), timeout_s=60)[0]
    # Each rank named with its own line: rank 0 in the save, the others where they are instead.
    busy = next(i + 1 for i, text in enumerate(Path(__file__).read_text().splitlines()) if "# busy elsewhere" in text)
    assert "save_checkpoint() is collective" in message and f"ranks 1-3 are in Python at test_api.py:{busy}" in \
        message, message
    assert seconds < 4
    assert not (tmp_path / "ckpt" / "latest").exists()


def test_consolidated_checkpoint_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    import transformers
    from safetensors.torch import load_file

    from minitrain.apps.ckpt import consolidate

    root = tmp_path / "ckpt"
    states = run_ranks(_save_then_continue, 2, str(root), "gpt2", 3)[0]
    del states
    export = tmp_path / "export"
    export.mkdir()
    consolidate(str(root), str(export / "model.safetensors"))
    trained = make_model("gpt2")
    state = load_file(str(export / "model.safetensors"))
    assert state.keys() == trained.state_dict().keys()  # exactly the model's keys, tied head and frozen norm
    trained.load_state_dict(state, strict=True)
    trained.config.save_pretrained(export)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True,
                                                                     dtype=torch.float64)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = batches(1, 4, seed=7)[0]
    assert torch.equal(loaded(input_ids=x).logits, trained(input_ids=x).logits)


def test_refused_inputs_say_what_to_fix():
    from minitrain.parallel.core.shard_optimizer import check_elementwise

    with pytest.raises(NotElementwiseError, match="not elementwise|could not be run"):
        check_elementwise(functools.partial(torch.optim.Adafactor, lr=1e-2), {})
    check_elementwise(OPTIMIZERS["adamw"], {"weight_decay": 0.1})  # elementwise: accepted
    model = make_model("gpt2")
    with pytest.raises(NotElementwiseError):
        minitrain.prepare(model, functools.partial(torch.optim.Adafactor, lr=1e-2), zero=1)
    with pytest.raises(ValueError, match="in no param group"):
        m = make_model("gpt2")
        minitrain.prepare(m, OPTIMIZERS["sgd"], param_groups=param_groups(m)[:1])
    with pytest.raises(ValueError, match="holds a tensor that is not a parameter of the model"):
        m = make_model("gpt2")
        minitrain.prepare(m, OPTIMIZERS["sgd"], param_groups=[{"params": [*m.parameters(), torch.zeros(2)]}])
    with pytest.raises(ValueError, match="precision must be fp32, bf16 or fp16, got 'fp8'"):
        minitrain.prepare(make_model("gpt2"), OPTIMIZERS["sgd"], precision="fp8")
    with pytest.raises(ValueError, match="keeps float32 master weights: give a float32 model"):
        minitrain.prepare(make_model("gpt2"), OPTIMIZERS["sgd"], precision="fp16")  # a float64 model
    with pytest.raises(ValueError, match="not returned by minitrain.prepare"):
        minitrain.clip_grad_norm_(make_model("gpt2"), 1.0)


def test_zero0_gives_a_non_elementwise_optimizer_whole_parameters():
    """Adafactor needs parameter shapes; at ZeRO-0 (one process) it sees them and matches plain PyTorch."""
    fn = functools.partial(torch.optim.Adafactor, lr=1e-2)
    ours, ref = make_model("gpt2"), make_model("gpt2")
    ours, opt = minitrain.prepare(ours, fn, zero=0)
    ref_opt = fn([p for p in ref.parameters() if p.requires_grad])
    for x in batches(3, 4):
        for model, o in ((ours, opt), (ref, ref_opt)):
            lm_loss(model, x).backward()
            o.step()
            o.zero_grad()
    for (key, a), b in zip(minitrain.full_state_dict(ours).items(), ref.state_dict().values()):
        assert (a - b).abs().max().item() <= 1e-12, key


def test_an_lr_scheduler_drives_the_prepared_optimizer_as_plain_pytorch():
    """torch.optim.lr_scheduler works on what prepare returns (its param_groups are the user's groups)."""
    def warmup(step):
        return min(1.0, (step + 1) / 3)

    ours, ref = make_model("llama"), make_model("llama")
    ours, opt = minitrain.prepare(ours, OPTIMIZERS["adamw"], zero=1, param_groups=param_groups(ours))
    ref_opt = OPTIMIZERS["adamw"](param_groups(ref))
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in (opt, ref_opt)]
    for x in batches(4, 4):
        for model, o, schedule in zip((ours, ref), (opt, ref_opt), schedules):
            lm_loss(model, x).backward()
            o.step()
            o.zero_grad()
            schedule.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups] == [1e-2, 1e-2]
    for (key, a), b in zip(minitrain.full_state_dict(ours).items(), ref.state_dict().values()):
        assert (a - b).abs().max().item() <= 1e-12, key


def _lab_names(topo):
    """The seed labs' calls: is_main_process, barrier, wrap_for_ddp with a plain torch optimizer."""
    rank, world = minitrain.init_distributed(topology=topo)
    torch.manual_seed(rank)  # different weights per rank: DDP must start them from rank 0's
    model = minitrain.wrap_for_ddp(torch.nn.Linear(3, 1).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(12, dtype=torch.float64).view(4, 3)[rank::world]
    model(x).square().mean().backward()
    opt.step()
    minitrain.barrier()
    return minitrain.is_main_process(), [p.detach().clone() for p in model.parameters()]


def test_the_labs_names_work():
    results = run_ranks(_lab_names, 2)
    assert [main for main, _ in results] == [True, False]
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1).double()
    torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.arange(12, dtype=torch.float64).view(4, 3)
    # rank r holds rows r::2: the mean of the two ranks' mean losses is the mean over all rows
    loss = sum(ref(x[r::2]).square().mean() for r in range(2)) / 2
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for _, params in results:
        for a, b in zip(params, ref.parameters()):
            assert (a - b).abs().max().item() <= 1e-12
