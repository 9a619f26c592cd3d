"""Pipeline parallelism: schedules as data (checked on an ideal clock, no processes), and real
pipelines of 2 and 4 stages whose gradients and losses equal the unpipelined run in float64, at any
number of micro-batches, with the bubble and the in-flight activations the schedules promise."""
import time

import pytest
import torch


from minitrain.train.run_config import run_config
from minitrain.parallel.pipeline_parallel.executor import stage_blocks
from minitrain.parallel.pipeline_parallel.schedules import (
    SCHEDULES,
    Action,
    DeadlockError,
    expected_bubble,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    simulate,
    simulated_bubble,
)
from minitrain.runtime.topology import Topology
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_main, run_ranks
from tests.helpers.reference import assert_close_to, assert_exercises_the_loop, plain_run

pytestmark = pytest.mark.slow

TOL = 1e-12
STEPS = 4


@pytest.mark.parametrize("name", [name for name in SCHEDULES if name != "interleaved"])
def test_schedules_run_every_micro_batch_once_without_deadlock_and_with_the_formula_bubble(name):
    split = name == "zero-bubble"
    for stages in range(1, 7):
        for microbatches in range(1, 13):
            schedule = SCHEDULES[name](stages, microbatches)
            kinds = "FBW" if split else "FB"
            for actions in schedule:
                assert sorted(map(str, actions)) == sorted(f"{k}{m}" for k in kinds for m in range(microbatches))
                assert all(actions.index(Action("F", m)) < actions.index(Action("B", m)) for m in range(microbatches))
                assert not split or all(actions.index(Action("B", m)) < actions.index(Action("W", m))
                                        for m in range(microbatches))
            if split:  # with F, B and W a tick each; below M = P the formula is a bound, 1F1B's bubble above it
                bubbles = simulated_bubble(simulate(schedule, 1, 2), stages)
                one_f_one_b_bubble = simulated_bubble(simulate(SCHEDULES["1f1b"](stages, microbatches), 1, 2), stages)
                if microbatches >= stages:
                    assert max(abs(b - expected_bubble(stages, microbatches, name)) for b in bubbles) < 1e-12
                assert max(bubbles) <= min(one_f_one_b_bubble) + 1e-12
                continue
            for backward_cost in (1, 2, 3):  # the bubble does not depend on the backward / forward ratio
                bubbles = simulated_bubble(simulate(schedule, 1, backward_cost), stages)
                assert max(abs(b - expected_bubble(stages, microbatches)) for b in bubbles) < 1e-12


def test_1f1b_holds_at_most_p_micro_batches_and_gpipe_all_m():
    for stages in range(1, 7):
        for microbatches in range(1, 13):
            assert [peak_in_flight(a) for a in one_f_one_b(stages, microbatches)] == \
                [min(stages - s, microbatches) for s in range(stages)]
            assert [peak_in_flight(a) for a in gpipe(stages, microbatches)] == [microbatches] * stages
            # Zero-bubble holds a micro-batch until its W: every stage as many as 1F1B's first stage.
            assert [peak_in_flight(a) for a in SCHEDULES["zero-bubble"](stages, microbatches)] == \
                [min(stages, microbatches)] * stages


def test_zero_bubble_needs_a_backward_it_can_split():
    with pytest.raises(ValueError, match="cannot be split"):
        simulate(SCHEDULES["zero-bubble"](2, 4), 1, 1)


def test_simulation_finds_a_deadlock():
    # The last stage wants to run backward 0 before its own forward 0; stage 0 waits on that backward.
    with pytest.raises(DeadlockError, match="stage 0 at B0, stage 1 at B0"):
        simulate([[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]])


def test_stages_get_contiguous_blocks_as_even_as_possible():
    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_blocks(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]


MODEL = {"model.n_layer": 4, "model.d_model": 32, "model.n_head": 4, "model.vocab_size": 64}


def _config(world, pp, microbatches=1, schedule="1f1b", zero=0, **values):
    return run_config(cli_values={"train.dtype": "float64", "train.zero": zero, "dist.nproc": world,
                                    "dist.pp": pp, "dist.microbatches": microbatches, "dist.schedule": schedule,
                                    "train.batch_size": 12, "train.log_every": 0,
                                    # between the steps' gradient norms: steps 1-2 unclipped, 3-4 clipped
                                    "train.grad_clip": 2.0, **MODEL, **values})


def _run(trainer):
    """Losses of STEPS steps, the gradients of the first step (synced, by parameter name) and the last
    step's pipeline record."""
    losses, grads, record = [], {}, None
    for step in range(STEPS):
        record = trainer.train_step()
        losses.append(record.loss)
        if step == 0:
            grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return losses, grads, record.pipeline


def _pipelined(topo, pp, runs):
    """One (schedule, micro-batches) run after another on the same ranks."""
    return [_run(Trainer(_config(topo.world_size, pp, m, schedule), topo.with_layout(1, pp))) for schedule, m in runs]


def _unpipelined():
    """Plain PyTorch in one process: the losses of STEPS steps and the first step's gradients by name."""
    ref = plain_run(_config(1, 1), STEPS)
    assert_exercises_the_loop(ref)
    first = plain_run(_config(1, 1), 1)
    return ref.losses, first.by_name(first.grads), None


RUNS = [(name, m) for name in SCHEDULES if name != "interleaved"  # (its own tests: it needs chunks)
        for m in (1, 2, 4, 12)]  # M < P, = P, > P; 12: one sequence per micro-batch


@pytest.mark.parametrize("pp", [2, 4])
def test_pipelined_gradients_and_losses_equal_the_unpipelined_run(pp):
    losses, grads, _ = _unpipelined()
    per_rank = run_ranks(_pipelined, pp, pp, RUNS, timeout_s=180)
    for (schedule, microbatches), results in zip(RUNS, zip(*per_rank)):
        seen = {}
        for stage, (stage_losses, stage_grads, record) in enumerate(results):
            seen.update(stage_grads)
            for name, g in stage_grads.items():
                assert (g - grads[name]).abs().max() <= TOL, (schedule, microbatches, stage, name)
            assert max(abs(a - b) for a, b in zip(stage_losses, losses)) <= TOL, (schedule, microbatches, stage)
            bound = {"gpipe": microbatches, "1f1b": min(pp - stage, microbatches)}.get(schedule, min(pp, microbatches))
            assert record["peak_in_flight"][stage] == bound, (schedule, microbatches, record)
        assert sorted(seen) == sorted(grads)  # the stages together hold every parameter, each once
    assert losses[-1] < losses[0]


def _sharded_and_recomputed(topo):
    out = {}
    for zero, recompute in ((2, "selective"), (3, "block")):
        cfg = _config(topo.world_size, 2, 3, "gpipe", zero, **{"train.batch_size": 6,
                                                               "train.activation_checkpointing": recompute})
        out[zero] = _run(Trainer(cfg, topo.with_layout(1, 2)))[0]
    return out


def test_pipeline_over_zero_2_and_3_replicas_with_recomputation_trains_like_one_process():
    """2 stages x 2 data-parallel replicas: ZeRO-2/3 shard each stage's state over its replicas, and hooks
    that gather and reduce per unit meet several micro-batches in flight (ZeRO-2 with selective
    recomputation, ZeRO-3 with block recomputation)."""
    losses = _unpipelined()[0]
    for rank, per_stage in enumerate(run_ranks(_sharded_and_recomputed, 4, timeout_s=180)):
        for zero, rank_losses in per_stage.items():
            assert max(abs(a - b) for a, b in zip(rank_losses, losses)) <= TOL, (rank, zero)


class _Slow(torch.nn.Module):
    """A stage whose forward and backward each take a fixed time, far above their compute, so the measured
    bubble can be compared with the formula on a busy 2-core machine."""

    def __init__(self, inner, seconds):
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, *args):
        time.sleep(self.seconds)
        return _SleepInBackward.apply(self.inner(*args), self.seconds)


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def _measured_bubble(topo, pp, microbatches):
    trainer = Trainer(_config(topo.world_size, pp, microbatches, "1f1b"), topo.with_layout(1, pp))
    trainer.pipeline.module = _Slow(trainer.pipeline.module, 0.02)
    return [trainer.train_step().pipeline for _ in range(3)]


def test_measured_bubble_matches_the_formula():
    records = run_ranks(_measured_bubble, 4, 4, 4)[0]
    expected = expected_bubble(4, 4)  # 3/7
    assert records[-1]["expected_bubble"] == pytest.approx(expected)
    for stage_bubble in records[-1]["bubble"]:  # sleeps of 20 ms dwarf the transfers and the scheduling noise
        assert abs(stage_bubble - expected) < 0.08, records[-1]


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "2", "--pp", "2", "--model.n_layer", "4", "--model.tie_weights", "true"],
     "cannot share a weight across stages"),
    (["--nproc", "2", "--pp", "2", "--dp", "torch"], "--dp torch with --pp 2 --microbatches 1"),
    (["--nproc", "2", "--microbatches", "2", "--dp", "torch"], "--dp torch with --pp 1 --microbatches 2"),
    (["--batch-size", "4", "--microbatches", "3"], "--microbatches 3 does not divide --batch-size 4"),
    (["--microbatches", "0"], "dist.microbatches must be"),
    (["--schedule", "zigzag"], "dist.schedule"),
])
def test_bad_pipeline_settings_exit_2_naming_them(argv, message):
    proc = run_main("train", *argv)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _data_and_pipeline(topo, schedule, zero=1):
    cfg = _config(topo.world_size, 2, 4, schedule, zero, **{"dist.virtual_stages": 2 if schedule == "interleaved" else 1})
    with Trainer(cfg, topo.with_layout(1, 2)) as trainer:
        losses = _run(trainer)[0]
        return losses, {n: q.detach().clone() for n, q in trainer.model.named_parameters()}


def test_zero_bubble_at_zero_1_over_two_replicas_ends_on_1f1b_s_parameters_and_one_process_s():
    ref = plain_run(_config(4, 2, 4, "1f1b", 1), STEPS)  # one process on both replicas' batches
    ranks = {schedule: run_ranks(_data_and_pipeline, 4, schedule) for schedule in ("1f1b", "zero-bubble")}
    for rank in (0, 2):  # a rank of each stage holds that stage's parameters
        mine, theirs = ranks["zero-bubble"][rank][1], ranks["1f1b"][rank][1]
        assert max((mine[n] - theirs[n]).abs().max().item() for n in mine) <= TOL, rank
    assert_close_to(ref, TOL, "zero-bubble, dp 2 x pp 2, ZeRO-1", losses=ranks["zero-bubble"][0][0])


@pytest.mark.parametrize("zero", [0, 1])
def test_interleaved_over_two_replicas_syncs_after_its_backwards_and_ends_on_1f1b_s_parameters(zero):
    ref = plain_run(_config(4, 2, 4, "1f1b", zero), STEPS)  # one process on both replicas' batches
    ranks = {schedule: run_ranks(_data_and_pipeline, 4, schedule, zero) for schedule in ("1f1b", "interleaved")}
    whole = {schedule: {} for schedule in ranks}
    for schedule, results in ranks.items():
        for _, named in results:
            whole[schedule].update(named)  # (the replicas agree: a later rank's copy replaces an equal one)
        assert_close_to(ref, TOL, f"{schedule}, dp 2 x pp 2, ZeRO-{zero}", losses=results[0][0])
    assert max((whole["interleaved"][n] - whole["1f1b"][n]).abs().max().item() for n in whole["1f1b"]) <= TOL


def test_zero_bubble_refuses_what_changes_its_noted_outputs(tmp_path):
    for flags in (["--tp", "2"], ["--train.activation_checkpointing", "block"], ["--zero", "2"]):
        proc = run_main("train", "--nproc", "4", "--pp", "2", "--microbatches", "2", "--dist.schedule",
                        "zero-bubble", "--steps", "1", "--out", str(tmp_path / "run"), *flags)
        assert proc.returncode == 2 and "--dist.schedule zero-bubble with" in proc.stderr, (flags, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1


def test_pp_schedule_prints_the_timeline():
    proc = run_main("pp-schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("stage ") and "|" in line]
    assert rows[0].split("|")[1].split()[:8] == ["F0", "F1", "F2", "F3", ".", ".", ".", "B0"]
    assert rows[3].split("|")[1].split()[:4] == [".", ".", ".", "F0"]
    assert "(P-1)/(M+P-1) = 27.3%" in proc.stdout
    assert run_main("pp-schedule", "--microbatches", "0").returncode == 2
    zb = run_main("pp-schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zero-bubble")
    assert zb.returncode == 0 and "a backward 2 (B 1 + W 1)" in zb.stdout and "(P-1)/(3M+P-1) = 11.1%" in zb.stdout
    rows = [line for line in zb.stdout.splitlines() if line.startswith("stage ") and "|" in line]
    assert rows[3].split("|")[1].split()[-4:] == ["W4", "W5", "W6", "W7"]  # the held-back W's fill the cool-down


RESUME_AT, LAST = 3, 6


def _checkpointed(topo, dp, pp, root, resume_from):
    """Train to step LAST with `dp` x `pp` ranks (the same global batch), saving at RESUME_AT, or
    starting from `resume_from`; returns the losses of the steps it ran."""
    cfg = _config(dp * pp, pp, 2 if pp > 1 else 1, "1f1b", **{"train.batch_size": 12 // dp})
    trainer = Trainer(cfg, topo.with_layout(1, pp) if topo.world_size > 1 else topo)
    if resume_from:
        trainer.load_checkpoint(resume_from)
    losses = []
    while trainer.step < LAST:
        losses.append(trainer.train_step().loss)
        if trainer.step == RESUME_AT and not resume_from:
            trainer.save_checkpoint(root)
    return losses


def test_a_pipeline_checkpoint_resumes_exactly_and_reshards_to_other_layouts(tmp_path):
    import json

    full = run_ranks(_checkpointed, 2, 1, 2, tmp_path, None)[-1]
    step_dir = tmp_path / "step-000003"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["layout"] == {"dp": 1, "tp": 1, "pp": 2} and manifest["zero"] == 0
    # Each stage wrote its own parameters: the files' pieces together cover the whole model once.
    assert {t["file"] for t in manifest["tensors"] if t["key"] == "params"} == {"rank-00000.safetensors",
                                                                                 "rank-00001.safetensors"}
    same = run_ranks(_checkpointed, 2, 1, 2, tmp_path, step_dir)[-1]
    assert same == full[RESUME_AT:]  # the same layout continues bit for bit
    for losses in (run_ranks(_checkpointed, 2, 2, 1, tmp_path, step_dir)[0],  # 2 stages -> 2 replicas
                   _checkpointed(Topology.single(), 1, 1, tmp_path, step_dir)):  # -> one process
        assert max(abs(a - b) for a, b in zip(losses, full[RESUME_AT:])) <= TOL


MAX_NORM = 0.5  # small enough that clipping scales every step's gradients


def _llama_pipelined(topo, schedule, layers=2):
    import minitrain
    from tests.helpers.hf_models import OPTIMIZERS, batches, make_model, param_groups
    from tests.helpers.refusal import refusal

    def loss_fn(logits, x):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))

    minitrain.init_distributed(topology=topo)
    refused = {}
    if schedule == "interleaved":  # what interleaving cannot do, said before anything is split
        llama = make_model("llama", layers=layers)
        for name, kwargs in {"chunks": {"virtual_stages": 3}, "groups": {"microbatches": 3},
                             "zero": {"zero": 2}, "one": {"virtual_stages": 1}}.items():
            refused[name] = refusal(lambda: minitrain.prepare(llama, OPTIMIZERS["adamw"], pp=2, pp_split="auto",
                                                              **{"microbatches": 4, "schedule": "interleaved",
                                                                 **kwargs}))
        refused["1f1b"] = refusal(lambda: minitrain.prepare(llama, OPTIMIZERS["adamw"], pp=2, pp_split="auto",
                                                            virtual_stages=2))
    model = make_model("llama", layers=layers)
    model, optimizer = minitrain.prepare(model, OPTIMIZERS["adamw"], param_groups=param_groups(model), pp=2,
                                         pp_split="auto", microbatches=4, schedule=schedule)
    losses, norms = [], []
    for x in batches(3, 8):
        losses.append(minitrain.pipeline_step(model, x, x, loss_fn))
        norms.append(float(minitrain.clip_grad_norm_(model, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.clone() for k, v in minitrain.full_state_dict(model).items()}
    minitrain.cleanup()
    return losses, norms, state, refused


def _same(run, other) -> float:
    """The largest difference of losses, norms and parameters between two runs' (losses, norms, state)."""
    (losses, norms, state), (their_losses, their_norms, their_state) = run[:3], other[:3]
    return max([abs(a - b) for a, b in zip(losses + norms, their_losses + their_norms)] +
               [(state[k] - their_state[k]).abs().max().item() for k in their_state])


def test_a_hugging_face_llama_through_prepare_trains_alike_on_zero_bubble_and_1f1b():
    zero_bubble, one_f_one_b = (run_ranks(_llama_pipelined, 2, schedule)[0] for schedule in ("zero-bubble", "1f1b"))
    assert _same(zero_bubble, one_f_one_b) <= TOL


def test_a_hugging_face_llama_interleaved_through_prepare_equals_1f1b_and_one_process():
    from tests.helpers.hf_models import batches, reference_run

    interleaved, one_f_one_b = (run_ranks(_llama_pipelined, 2, schedule, 4)[0] for schedule in ("interleaved", "1f1b"))
    ref = reference_run("llama", "adamw", batches(3, 8), MAX_NORM, layers=4)
    one_process = (ref["losses"], ref["norms"], {k: v for k, v in ref["state"].items() if "rotary" not in k})
    assert min(ref["norms"]) > MAX_NORM  # every step clipped
    assert _same(interleaved, one_f_one_b) <= TOL and _same(interleaved, one_process) <= TOL
    refused = interleaved[3]
    assert "4 blocks of model.layers into pp x virtual_stages = 2 x 3" in refused["chunks"], refused
    assert "microbatches=3 must be a multiple of it" in refused["groups"], refused
    assert "zero=2: not combined yet" in refused["zero"], refused
    assert "virtual_stages of 2 or more" in refused["one"], refused
    assert "virtual_stages=2 is for schedule='interleaved', not '1f1b'" in refused["1f1b"], refused


def test_the_interleaved_schedule_runs_every_chunk_once_with_its_bubble_and_messages_in_matching_order():
    from minitrain.parallel.pipeline_parallel.schedules import interleaved

    for P in range(2, 6):
        for V in (2, 3):
            for M in (P, 2 * P, 3 * P):
                schedule = interleaved(P, M, V)
                for actions in schedule:
                    assert sorted(map(str, actions)) == sorted(str(Action(k, m, c)) for k in "FB" for m in range(M)
                                                               for c in range(V))
                bubbles = simulated_bubble(simulate(schedule, 1, 1), P)
                assert max(abs(b - expected_bubble(P, M, "interleaved", V)) for b in bubbles) < 1e-12
                # Point to point between two ranks matches in order (NCCL has no tags): what a rank sends another,
                # in its order, is what that rank receives from it, in its order.
                sent, received = {}, {}
                for s_, actions in enumerate(schedule):
                    for a in actions:
                        v, forward = a.chunk * P + s_, a.kind == "F"
                        if (v > 0) if forward else (v < P * V - 1):  # it receives
                            peer = (s_ - 1) % P if forward else (s_ + 1) % P
                            received.setdefault((peer, s_), []).append((a.kind, a.microbatch, v - 1 if forward else v + 1))
                        if (v < P * V - 1) if forward else (v > 0):  # it sends
                            peer = (s_ + 1) % P if forward else (s_ - 1) % P
                            sent.setdefault((s_, peer), []).append((a.kind, a.microbatch, v))
                assert sent == received, (P, V, M)
    with pytest.raises(ValueError, match="a multiple of the 2 stages"):
        interleaved(2, 3, 2)


def _interleaved(topo, runs, zero=0):
    """Each (schedule, virtual stages) run of 4 micro-batches on pp = world stages: losses, first-step gradients,
    the pipeline record and this stage's parameters."""
    out = []
    for schedule, virtual in runs:
        cfg = _config(topo.world_size, topo.world_size, 4, schedule, zero, **{"dist.virtual_stages": virtual})
        with Trainer(cfg, topo.with_layout(1, topo.world_size)) as trainer:
            named = {n: q.detach().clone() for n, q in trainer.model.named_parameters()}  # this rank's blocks
            out.append((*_run(trainer), named))
    return out


def test_interleaved_over_two_chunks_equals_1f1b_and_one_process():
    losses, grads, _ = _unpipelined()
    for zero in (0, 1):
        per_rank = run_ranks(_interleaved, 2, [("interleaved", 2), ("1f1b", 1)], zero)
        whole = [{}, {}]  # each schedule's parameters, from both ranks (they hold other blocks under each)
        for stage, ((il_losses, il_grads, record, il_params), (_, _, _, params)) in enumerate(per_rank):
            assert max(abs(a - b) for a, b in zip(il_losses, losses)) <= TOL, (zero, stage)
            assert all((g - grads[name]).abs().max() <= TOL for name, g in il_grads.items()), stage
            assert record["virtual_stages"] == 2 and record["expected_bubble"] == 1 / 9
            whole[0].update(il_params)
            whole[1].update(params)
        assert whole[0].keys() == whole[1].keys() == grads.keys()
        assert max((whole[0][n] - whole[1][n]).abs().max().item() for n in grads) <= TOL, zero


def test_interleaved_refuses_chunks_that_do_not_divide_the_blocks(tmp_path):
    for flags, message in ((["--dist.virtual_stages", "3"], "equal chunks"),
                           (["--microbatches", "3", "--batch-size", "12"], "a multiple of it"),
                           (["--dist.virtual_stages", "1"], "go together"), (["--zero", "3"], "not combined yet")):
        proc = run_main("train", "--nproc", "2", "--pp", "2", "--microbatches", "2", "--dist.schedule", "interleaved",
                        "--dist.virtual_stages", "2", "--steps", "1", "--model.n_layer", "4", "--out",
                        str(tmp_path / "run"), *flags)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    shown = run_main("pp-schedule", "--pp", "2", "--microbatches", "4", "--schedule", "interleaved")
    assert shown.returncode == 0 and "(P-1)/(VM+P-1) = 11.1% with V = 2" in shown.stdout, shown.stdout
