"""The speed path on a CUDA device: run where one is present (a lent GPU machine), skipped cleanly elsewhere.

    .venv/bin/python -m pytest -m gpu -q      # on a machine with a GPU
"""
import warnings

import pytest
import torch


from minitrain import Prefetcher
from minitrain.train.run_config import run_config
from minitrain.runtime.topology import Topology
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]


def _trainer(**values):
    cfg = run_config(cli_values={"model.preset": "small", "train.log_every": 0, **values})
    return Trainer(cfg, Topology.single("cuda"))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_step_on_the_gpu_times_its_phases_with_events(precision):
    trainer = _trainer(**{"train.precision": precision})
    records = [trainer.train_step() for _ in range(3)]
    assert all(r.loss == r.loss and r.grad_norm > 0 for r in records)
    assert (records[-1].loss_scale is not None) == (precision == "fp16")  # fp16 steps through the loss scaler
    phases = records[-1].phases_s
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
    assert trainer.strategy.flat.data.is_cuda and records[-1].memory_peak["device"][0] > 0


def test_a_step_syncs_the_host_twice_at_most():
    # The gradient norm (the update's skip decision) and the statistics exchange; nothing else.
    trainer = _trainer(**{"train.precision": "bf16"})
    trainer.train_step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 2, [str(w.message) for w in syncs]


def test_a_late_step_never_makes_the_host_wait_for_the_device():
    # --train.late_stats (auto: on here): each step's statistics are read while the next step runs, so the host
    # launches step after step without waiting; the figures are the read-at-once ones, a step later.
    late, at_once = _trainer(**{"train.precision": "bf16"}), _trainer(**{"train.precision": "bf16"})
    assert late.late_stats
    late.launch_step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            records = [late.launch_step() for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno} {w.message}" for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], syncs
    records.append(late.settle())
    expected = [at_once.train_step() for _ in range(4)]
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert records[0].loss == expected[0].loss  # the same first forward, bit for bit
    torch.testing.assert_close([r.loss for r in records], [r.loss for r in expected], rtol=1e-3, atol=0)
    assert late.strategy.optimizer.steps_taken == 4


def test_compiled_bf16_matches_eager_on_the_gpu():
    eager, compiled = _trainer(**{"train.precision": "bf16"}), _trainer(**{"train.precision": "bf16",
                                                                            "train.compile": True})
    a = [eager.train_step().loss for _ in range(3)]
    b = [compiled.train_step().loss for _ in range(3)]
    torch.testing.assert_close(b, a, rtol=2e-2, atol=0)


def test_bench_throughput_on_the_gpu_reports_mfu_against_the_data_sheet(tmp_path):
    result = run_cli("bench", "throughput", "--preset", "small", "--precision", "bf16", "--steps", "5", "--rounds",
                     "2", "--out", "tp", cwd=tmp_path, timeout_s=600)
    assert result.returncode == 0, result.stderr
    assert "MFU" in result.stdout


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 64)).cuda()


def _api_steps(model, opt, steps):
    import minitrain

    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 8), generator=g).cuda()
        logits = model(x)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64).float(), x[:, 1:].reshape(-1)).backward()
        minitrain.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_api_on_cuda_in_bf16_saves_and_resumes_bit_identically(zero, tmp_path):
    import functools

    import minitrain

    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    model, opt = minitrain.prepare(_tiny_model(), adamw, zero=zero, precision="bf16")
    assert all(p.is_cuda for p in model.parameters())  # prepare keeps the model on its GPU
    _api_steps(model, opt, 2)
    minitrain.save_checkpoint(tmp_path, model, opt, 2)
    _api_steps(model, opt, 2)
    again, again_opt = minitrain.prepare(_tiny_model(), adamw, zero=zero, precision="bf16")
    minitrain.load_checkpoint(tmp_path, again, again_opt)
    assert all(t.is_cuda for state in again_opt.inner.state.values() for k, t in state.items() if k != "step")
    _api_steps(again, again_opt, 2)
    a, b = minitrain.full_state_dict(model), minitrain.full_state_dict(again)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_zero_stage_trains_on_the_gpu(zero):
    trainer = _trainer(**{"train.precision": "bf16", "train.zero": zero})
    records = [trainer.train_step() for _ in range(3)]
    assert all(r.loss == r.loss for r in records) and records[-1].busy_s_per_rank[0] > 0


def test_batches_are_made_ahead_in_pinned_memory_and_copied_without_blocking():
    trainer = _trainer(**{"data.prefetch": 2})
    x, y = trainer.loader.next_batch()
    assert x.is_pinned() and y.is_pinned()  # the prefetch thread pinned them: the step's copy is asynchronous
    trainer.train_step()
    with Prefetcher([(x, y)], device="cuda") as batches:
        (gx, gy), = list(batches)
    assert gx.is_cuda and torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y)


def test_an_async_snapshot_goes_to_pinned_host_memory(tmp_path):
    from minitrain.checkpoint.writing import ShardWrite

    trainer = _trainer(**{"train.precision": "bf16", "train.zero": 2})
    trainer.train_step()
    job = ShardWrite(tmp_path, 1, trainer.topo, trainer.strategy, {}, {}, copy=True)
    assert all(t.is_pinned() for k, t in job.shards.items() if not k.startswith("rng."))
    job._arrived.synchronize()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offload_keeps_the_state_on_the_host_and_trains_as_without(zero, offload, tmp_path):
    # The model on the GPU, the master and Adam state (and at ZeRO-2/3 the gradient shard) on the host. The host's
    # Adam kernel rounds otherwise than the GPU's (on a CPU-only machine the two runs are bit-identical:
    # tests/parallel/zero/test_offload.py), so here the masters agree to far less than one step's change: an update lost, doubled
    # or taken with a stale gradient would move them by about a whole step.
    def run(mode):
        values = {"train.precision": "bf16", "train.zero": zero, "train.offload": mode, "out": str(tmp_path / mode)}
        with _trainer(**values) as trainer:
            s = trainer.strategy
            before = s.optimizer.master.detach().cpu().clone()
            losses = [trainer.train_step().loss for _ in range(3)]
            where = {"params": s.held_params().device.type, "master": s.optimizer.master.device.type,
                     "grads": s.held_grads().device.type, "decay in the kernel": s.optimizer._fold}
            # Published exactly: the parameters are the master rounded to bf16, every element (world 1: the shard is
            # everything), whether the rounding ran on the host or on the device after the copy.
            published = s.held_params().detach().cpu()
            assert torch.equal(published, s.optimizer.master.detach().cpu().to(published.dtype)), (zero, mode)
            return losses, before, s.optimizer.master.detach().cpu().clone(), where

    plain, ours = run("none"), run(offload)
    torch.testing.assert_close(ours[0], plain[0], rtol=1e-3, atol=0)
    assert torch.equal(ours[1], plain[1])
    # In norm: a weight whose gradient is near zero can take the other sign once a bf16 rounding differs, and Adam
    # then moves it by a whole step the other way (measured on an H200: 0.0053 at most, of 0.0076 moved).
    moved, apart = (plain[2] - plain[1]).norm(), (ours[2] - plain[2]).norm()
    assert apart < 0.05 * moved, (apart, moved)
    # The host's kernel applies the weight decay as the device's does (one pass over the host's master fewer).
    assert ours[3] == {"params": "cuda", "master": "cpu", "grads": "cpu" if zero >= 2 else "cuda",
                       "decay in the kernel": True}, ours[3]


def _losses(steps=4, **values):
    trainer = _trainer(**{"train.batch_size": 8, **values})
    return [trainer.train_step().loss for _ in range(steps)]


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_activation_checkpointing_on_the_gpu_recomputes_the_same_step(mode):
    # The recomputed forward runs the same kernels on the same inputs; only atomics in a backward could part them.
    plain = _losses(**{"train.precision": "bf16"})
    torch.testing.assert_close(_losses(**{"train.precision": "bf16", "train.activation_checkpointing": mode}), plain,
                               rtol=1e-3, atol=0)


def test_a_pipeline_of_micro_batches_on_the_gpu_equals_the_whole_batch():
    # One stage (a pipeline of several needs a GPU per stage): four micro-batches through the 1F1B schedule.
    whole = _losses(**{"train.precision": "fp32"})
    torch.testing.assert_close(_losses(**{"train.precision": "fp32", "dist.microbatches": 4}), whole, rtol=1e-5, atol=0)


def test_a_mixture_of_experts_trains_on_the_gpu():
    trainer = _trainer(**{"train.precision": "bf16", "model.moe_experts": 4, "model.moe_top_k": 2})
    records = [trainer.train_step() for _ in range(3)]
    assert all(r.loss == r.loss for r in records) and records[0].loss > records[-1].loss
    assert records[-1].expert_load and all(sum(layer) > 0 for layer in records[-1].expert_load)


@pytest.mark.parametrize("zero", [0, 3])
def test_a_hugging_face_model_on_the_gpu_equals_plain_pytorch_on_the_cpu(zero):
    # The public API on a Llama nobody here wrote, in float64 on the GPU, against the unwrapped model on the CPU.
    import minitrain

    from tests.helpers.hf_models import OPTIMIZERS, batches, lm_loss, make_model, param_groups, reference_run

    pytest.importorskip("transformers")
    steps = batches(3, 8)
    reference = reference_run("llama", "adamw", steps, 0.5)
    model = make_model("llama").cuda()
    model, opt = minitrain.prepare(model, OPTIMIZERS["adamw"], zero=zero, param_groups=param_groups(model))
    losses = []
    for x in steps:
        loss = lm_loss(model, x.cuda())
        loss.backward()
        minitrain.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # float64 on both sides; the GPU's kernels sum in other orders than the CPU's, and Adam's first steps move a
    # weight by about lr whatever its gradient's size, so a gradient near zero (its sum nearly cancelling) can take
    # a last-digit difference to 1.2e-7 (measured on an H200). The tolerance is
    # still 1e-4 of one step (lr = 1e-2).
    torch.testing.assert_close(losses, reference["losses"], rtol=1e-9, atol=0)
    state = minitrain.full_state_dict(model)
    for name, value in reference["state"].items():
        torch.testing.assert_close(state[name].cpu(), value, rtol=1e-7, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


LAYOUTS = [(0, "bucketed"), (0, "naive"), (0, "torch"), (1, "bucketed"), (2, "bucketed"), (3, "bucketed")]


def _every_layout_through_nccl(topo, root):
    """World 1 through a real NCCL process group, every collective handed to NCCL (a group of one would skip
    them): each layout trains, saves at step 3, and a fresh trainer resumed from that checkpoint ends step 6 with
    the same bytes as the run that went on."""
    from pathlib import Path

    from minitrain.parallel.core.sync_stats import same_state

    topo = topo.issuing_alone()
    out = {}
    for zero, mode in LAYOUTS:
        values = {"model.preset": "small", "train.zero": zero, "ddp.mode": mode, "train.precision": "bf16",
                  "train.steps": 6, "train.log_every": 0}
        trainer = Trainer(run_config(cli_values=values), topo)
        records = [trainer.train_step() for _ in range(3)]
        saved = trainer.save_checkpoint(Path(root) / f"z{zero}-{mode}")
        records += [trainer.train_step() for _ in range(3)]
        final = trainer.strategy.state_snapshot()
        fresh = Trainer(run_config(cli_values=values), topo)
        fresh.load_checkpoint(saved)
        resumed = [fresh.train_step().loss for _ in range(3)]
        last = records[-1]
        out[(zero, mode)] = {"backend": topo.backend, "device": str(next(trainer.model.parameters()).device),
                             "resumed_equal": same_state(fresh.strategy.state_snapshot(), final)
                             and resumed == [r.loss for r in records[3:]],
                             "comm_s": last.comm_time_s, "comm_calls": last.comm_calls, "step_s": last.step_time_s,
                             # A step reports the device time of the step read before it (trainer._phases: its
                             # events are read after the exchange that carries the busy time).
                             "busy_s": last.busy_s_per_rank[0], "busy_step_s": records[-2].step_time_s,
                             "phases": last.phases_s}
    return out


def test_every_zero_stage_and_data_parallel_mode_through_nccl_resumes_bit_identically(tmp_path):
    from minitrain.runtime.launch import launch

    [results] = launch(_every_layout_through_nccl, 1, str(tmp_path), backend="nccl", timeout_s=300)
    for layout, r in results.items():
        assert r["backend"] == "nccl" and r["device"].startswith("cuda"), (layout, r)
        assert r["resumed_equal"], layout
        # Collectives timed with device events: non-zero, and inside the step the phases add up to.
        assert r["comm_calls"] > 0 and 0 < r["comm_s"] < r["step_s"], (layout, r)
        assert 0 < r["busy_s"] <= r["busy_step_s"] * 1.1, (layout, r)
        assert abs(sum(v for v in r["phases"].values() if v is not None) - r["step_s"]) <= 0.1 * r["step_s"], r
