"""A user's habits and slips: none loses work or misleads. (Ctrl-C and SIGHUP: tests/system/test_fault_tolerance.py.)

Each test fails on the code before the fix it names."""
from __future__ import annotations

import functools
import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minitrain
from minitrain.checkpoint import CheckpointError

from tests.helpers.dist import run_main, run_ranks

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
V, D, T = 16, 8, 6
TOL = 1e-12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def net() -> nn.Module:
    return Net().double()


def loss_of(model, x):
    logits = model(x)
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))


def batches(steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, V, (4, T), generator=g) for _ in range(steps)]


def _one_line(result, match: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and match in result.stderr, result.stderr


# --- the command line ---------------------------------------------------------------------------------------
def test_a_checkpoint_directory_that_cannot_be_written_is_refused_at_startup(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the checkpoints go")
    _one_line(run_main("train", "--steps", "2", "--out", str(out), "--resume", "auto"),
              "cannot write to the checkpoint directory")
    assert not (out / "metrics.jsonl").exists()  # nothing half-written


@pytest.mark.parametrize("seed", ["-1", str(2 ** 67)])
def test_a_seed_out_of_range_is_refused_at_startup(tmp_path, seed):
    _one_line(run_main("train", "--seed", seed, "--out", str(tmp_path / "run")), "--seed must be an integer in [0, 2^63)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", [".lock", pytest.param("metrics.jsonl", marks=pytest.mark.multirank)])
def test_run_files_are_never_written_through_a_symbolic_link(tmp_path, name):
    """A .lock link truncated its target; a dangling metrics.jsonl link was written through."""
    out, target = tmp_path / "run", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("keep me\n")
    (out / name).symlink_to(target if name == ".lock" else tmp_path / "elsewhere.jsonl")
    result = run_main("train", "--steps", "2", "--train.log_every", "0", "--out", str(out), "--resume", "auto")
    assert result.returncode in (1, 2) and "symbolic link" in result.stdout + result.stderr
    assert target.read_text() == "keep me\n" and not (tmp_path / "elsewhere.jsonl").exists()


@pytest.mark.multirank
def test_a_fresh_start_keeps_an_earlier_attempts_metrics_and_eval_batches_are_noted(tmp_path):
    """--resume auto with no checkpoint started at step 0 and replaced the old metrics.jsonl."""
    out = tmp_path / "run"
    out.mkdir()
    earlier = json.dumps({"step": 1, "loss": 9.0}) + "\n"
    (out / "metrics.jsonl").write_text(earlier)
    result = run_main("train", "--steps", "2", "--train.log_every", "0", "--out", str(out), "--resume", "auto",
                      "--eval-every", "2", "--eval-batches", "500")
    assert result.returncode == 0, result.stderr
    assert "--eval-batches 500 asks for more than the held-out split" in result.stderr
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert lines[0] + "\n" == earlier and json.loads(lines[1])["event"] == "start over"
    assert [json.loads(line)["step"] for line in lines[2:]] == [1, 2]


def test_report_reads_a_line_with_a_malformed_field(tmp_path):
    lines = [{"step": 1, "loss": 3.0, "phases_s": {"forward": "x"}}, {"step": 2, "loss": 2.0, "memory_peak": "?"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run_main("report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "malformed fields" in result.stdout


def test_data_prepare_on_a_megabyte_without_spaces_is_quick_and_exact(tmp_path):
    from minitrain.corpus.tokenizer import decode, load_tokenizer
    from tests.helpers.prepared_corpus import stream_of

    text = "a" * 1_000_000 + " and then ordinary words.\n"
    (tmp_path / "long.txt").write_text(text)
    start = time.perf_counter()
    result = run_main("data", "prepare", str(tmp_path / "long.txt"), "--vocab-size", "300", "--out",
                      str(tmp_path / "prep"), "--val-fraction", "0.5")
    assert result.returncode == 0, result.stderr
    assert time.perf_counter() - start < 30  # it ran past 5 minutes
    tok = load_tokenizer(tmp_path / "prep" / "tokenizer.json")
    assert decode(tok, stream_of(tmp_path / "prep").tolist()).replace("<|endoftext|>", "") == text


# --- the API, one process -----------------------------------------------------------------------------------
def test_a_checkpoint_step_must_name_a_step(tmp_path):
    model, opt = minitrain.prepare(net(), ADAMW)
    for step in (-1, 2.0, True):
        with pytest.raises(ValueError, match="step must be a non-negative integer"):
            minitrain.save_checkpoint(tmp_path, model, opt, step)
    assert not (tmp_path / "latest").exists()


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    model, opt = minitrain.prepare(net(), ADAMW, zero=1)
    loss_of(model, batches(1)[0]).backward()
    opt.step()
    minitrain.save_checkpoint(tmp_path, model, opt, 1)
    other, sgd = minitrain.prepare(net(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), zero=1)
    with pytest.raises(CheckpointError, match="holds the state of a torch.optim.adamw.AdamW, and this optimizer is "
                                              "a torch.optim.sgd.SGD"):
        minitrain.load_checkpoint(tmp_path, other, sgd)


def test_messages_name_the_likely_cause():
    model, opt = minitrain.prepare(net(), ADAMW, zero=1)
    with pytest.raises(RuntimeError, match="no parameter got a gradient this step: optimizer.step\\(\\) came "
                                           "without a backward"):
        opt.step()
    # A trainer's micro-batch run outside no_sync after the sync began (a loop of minitrain's own API syncs each
    # backward when it ends, as DDP does, so there it is a second sync, not this error).
    from minitrain.runtime.comm import Comm
    from minitrain.parallel import ParallelConfig, make_strategy
    from minitrain.parallel.core.shard_optimizer import TorchShardOptimizer

    model = net()
    names = [n for n, _ in model.named_parameters()]
    strategy = make_strategy(model, Comm(), ParallelConfig(bucket_mb=1e-6, master_dtype=torch.float64,  # noqa: F841 - its hooks act
                                                           reduce_dtype=torch.float64),
                             lambda master, flat, ranges: TorchShardOptimizer(master, flat, ranges, False, ADAMW,
                                                                              [(names, {})]))
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="minitrain.no_sync\\(model\\) in a loop of your own"):
        loss_of(model, x).backward()
        loss_of(model, x).backward()  # a second backward while the first's buckets are in flight


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_a_misused_optimizer_or_a_freeze_after_prepare_is_named(zero):
    """LBFGS (whose step re-evaluates the loss), made or its maker, and a parameter frozen after prepare: each
    refused saying what to do, where they used to end in a raw TypeError from inside, a refusal advising zero=0
    (which refused too), or at ZeRO-3 a message about a module's outputs."""
    model = net()
    for optimizer in (torch.optim.LBFGS, torch.optim.LBFGS(model.parameters())):
        with pytest.raises(ValueError, match="LBFGS.step\\(closure\\) evaluates the loss itself"):
            minitrain.prepare(model, optimizer, zero=zero)
    model, opt = minitrain.prepare(model, ADAMW, zero=zero)
    with pytest.raises(ValueError, match="clips by the 2-norm \\(norm_type=2.0\\), got norm_type=1"):
        minitrain.clip_grad_norm_(model, 1.0, norm_type=1)  # torch's argument, which used to be a TypeError
    model.emb.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="frozen \\(requires_grad_\\(False\\)\\) after prepare, which had "
                                           "taken them to train: emb.weight; freeze parameters before prepare"):
        loss_of(model, batches(1)[0]).backward()
        opt.step()


class WithOptionalLayer(Net):
    """Net with a layer a step's forward may leave out."""

    def __init__(self):
        super().__init__()
        self.optional = nn.Linear(D, D)

    def forward(self, x, use_optional=True):
        h = self.emb(x)
        h = self.optional(h) if use_optional else h
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _optional_loss(model, x, use_optional):
    logits = model(x, use_optional)
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))


def _train_alike(zero, dp, uses, set_to_none, ours_set_to_none=None):
    """Plain torch and prepare(zero, dp) trained one step per entry of `uses` (whether the forward takes the optional
    layer), each zero_grad(set_to_none) after each step (ours_set_to_none: prepare's, where it differs); asserts the
    parameters match and each p.grad is what its zero_grad leaves."""
    ours_set_to_none = set_to_none if ours_set_to_none is None else ours_set_to_none
    ref = WithOptionalLayer().double()
    ref_opt = ADAMW(ref.parameters())
    model, opt = minitrain.prepare(WithOptionalLayer().double(), ADAMW, zero=zero, dp=dp)
    for m, o, none in ((ref, ref_opt, set_to_none), (model, opt, ours_set_to_none)):
        for x, use_optional in zip(batches(len(uses)), uses):
            _optional_loss(m, x, use_optional).backward()
            o.step()
            o.zero_grad(set_to_none=none)
        assert all(p.grad is None if none else not p.grad.any() for p in m.parameters())
    state = minitrain.full_state_dict(model)
    for key, value in ref.state_dict().items():
        assert (state[key] - value).abs().max().item() <= TOL, key


@pytest.mark.parametrize("zero,dp", [(0, "naive"), (0, "bucketed"), (1, "bucketed")])
def test_zero_grad_leaves_none_as_torch_and_a_missed_gradient_is_a_zero_not_the_step_before_s(zero, dp):
    """optimizer.zero_grad() (set_to_none, torch's default) at ZeRO-0/1 leaves every p.grad None, as torch's does
    (and as prepare leaves them), and the next backward's gradients land in the flat buffer, which used to be
    zero-filled for them. A parameter that backward then misses would find its part of the buffer holding the step
    before's gradient: the naive sync takes it as a zero, as the zero-filled buffer gave it (torch's zero_grad with
    set_to_none=False does the same); a bucketed one refuses the step, naming it, as DDP does."""
    _train_alike(zero, dp, (True, True, True), set_to_none=True)
    model, opt = minitrain.prepare(WithOptionalLayer().double(), ADAMW, zero=zero, dp=dp)
    assert all(p.grad is None for p in model.parameters())  # as torch's before the first backward
    if dp == "naive":
        _train_alike(zero, dp, (True, False, True), set_to_none=False, ours_set_to_none=True)
        _train_alike(zero, dp, (True, False, True), set_to_none=False)
        return
    x, y = batches(2)
    _optional_loss(model, x, True).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="no gradient reached optional.weight, optional.bias this step"):
        _optional_loss(model, y, False).backward()
        opt.step()


# --- the API, 2 ranks ---------------------------------------------------------------------------------------
CLIP = 0.05  # below every batch's norm here: each step is clipped, so a norm from the wrong batch changes it


def _drops_two_batches(prepared, topo=None) -> tuple[dict, list[float]]:
    """A loss-spike guard's habit: batch 0 dropped after its norm was read (backward, clip_grad_norm_, zero_grad, no
    step), batch 1 dropped at once (backward, zero_grad), batches 2 and 3 stepped with clipping. The parameters
    and the norms the clip returned."""
    model, opt = prepared
    clip = torch.nn.utils.clip_grad_norm_ if topo is None else minitrain.clip_grad_norm_
    norms = []
    for i, x in enumerate(batches(4)):
        loss_of(model, x if topo is None else x.chunk(topo.world_size)[topo.rank]).backward()
        if i != 1:
            norms.append(float(clip(model.parameters() if topo is None else model, CLIP)))
        if i >= 2:
            opt.step()
        opt.zero_grad()
    return (model.state_dict() if topo is None else minitrain.full_state_dict(model)), norms


EDITED = ((2, "none"), (0, "cpu"), (1, "cpu"))  # (zero, offload): the layouts whose optimizer steps a master of its own


def _edits_in_place(prepared, topo=None) -> dict:
    """Parameters edited in place between steps, as a weight constraint and a re-initialisation are: every weight
    clamped after each step, the head's bias zeroed by torch.nn.init before the second. The parameters."""
    model, opt = prepared
    for i, x in enumerate(batches()):
        if i == 1:
            torch.nn.init.zeros_(model.head.bias)
        loss_of(model, x if topo is None else x.chunk(topo.world_size)[topo.rank]).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.3, 0.3)
    return model.state_dict() if topo is None else minitrain.full_state_dict(model)


def _two_ranks(topo):
    minitrain.init_distributed(topology=topo)
    out = {}
    for zero in range(4):  # no zero_grad between steps: torch accumulates, so must every stage
        model, opt = minitrain.prepare(net(), ADAMW, zero=zero)
        for x in batches():
            loss_of(model, x.chunk(topo.world_size)[topo.rank]).backward()
            opt.step()
        out[zero] = minitrain.full_state_dict(model)
        out[("dropped", zero)] = _drops_two_batches(minitrain.prepare(net(), ADAMW, zero=zero), topo)
    for zero, offload in EDITED:
        out[("edited", zero, offload)] = _edits_in_place(minitrain.prepare(net(), ADAMW, zero=zero, offload=offload),
                                                         topo)
    for kind in ("tp", "pp"):  # the batch[rank::world] habit: each rank of one replica fed its own rows
        layout = {"tp": 2, "tp_plan": {"blocks.*.lin": "colwise_gather_output"}} if kind == "tp" else \
            {"pp": 2, "pp_split": ["emb", "blocks", "head"]}
        model, opt = minitrain.prepare(net(), ADAMW, **layout)
        x = batches(1)[0][topo.rank::topo.world_size]
        try:
            if kind == "tp":
                loss_of(model, x).backward()
            else:
                minitrain.pipeline_step(model, x, x, lambda logits, y: F.cross_entropy(
                    logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1)))
            opt.step()
            out[kind] = "trained on"
        except ValueError as e:
            out[kind] = str(e)
    dist.barrier()
    return out


def test_habits_over_ranks():
    results = run_ranks(_two_ranks, 2, timeout_s=120)
    ref = net()
    opt = ADAMW(ref.parameters())
    for x in batches():
        loss_of(ref, x).backward()  # never zeroed: each step's gradient adds to the last
        opt.step()
    model = net()
    dropped, norms = _drops_two_batches((model, ADAMW(model.parameters())))
    model = net()
    edited = _edits_in_place((model, ADAMW(model.parameters())))
    for out in results:
        for zero in range(4):
            for key, value in ref.state_dict().items():
                assert (out[zero][key] - value).abs().max().item() <= 1e-10, (zero, key)
            # A dropped batch leaves nothing behind: not its norm (read again by the next clip), not its gradient
            # (a reduction still in flight at ZeRO-2/3, written into a shard zero_grad gave back).
            state, our_norms = out[("dropped", zero)]
            assert our_norms == pytest.approx(norms, rel=1e-12, abs=0), (zero, our_norms, norms)
            for key, value in dropped.items():
                assert (state[key] - value).abs().max().item() <= 1e-10, (zero, key)
        # Edited in place between steps, where the step publishes a master of its own: the edits are kept (the
        # next step used to write the unedited master back over them).
        for zero, offload in EDITED:
            for key, value in edited.items():
                assert (out[("edited", zero, offload)][key] - value).abs().max().item() <= 1e-10, (zero, offload, key)
        for kind in ("tp", "pp"):
            assert "ranks [0] vs [1] hold one model replica (dp_rank 0) but were fed different" in out[kind], out[kind]
