"""Tensor parallelism: each split layer equals its full counterpart (outputs and gradients), and
training split across 2 or 4 ranks follows plain PyTorch in one process (tests/helpers/reference.py) to float64
rounding."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn


from minitrain.train.run_config import run_config
from minitrain.parallel.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                       vocab_parallel_cross_entropy)
from minitrain.runtime.topology import Topology, layout_groups
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_main, run_ranks
from tests.helpers.reference import assert_close_to, assert_exercises_the_loop, plain_run

TOL = 1e-12


def _layers_against_full(topo):
    """Every rank builds the same full layers and inputs; returns max |split - full| per quantity."""
    comm = topo.with_layout(topo.world_size, 1).tp
    torch.manual_seed(0)
    full = nn.Linear(8, 12).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    weight = torch.randn(3, 5, 12, dtype=torch.float64)  # a loss that weighs every output differently
    x_full = x.clone().requires_grad_()
    (full(x_full) * weight).sum().backward()
    size = 12 // comm.world_size
    rows = torch.arange(comm.rank * size, (comm.rank + 1) * size)
    diffs = {}

    column = ColumnParallelLinear(full, rows, comm)
    x_col = x.clone().requires_grad_()
    y = column(x_col)
    (y * weight[..., rows]).sum().backward()
    diffs["column output"] = (y - full(x)[..., rows]).abs().max()
    diffs["column input grad"] = (x_col.grad - x_full.grad).abs().max()  # f summed the ranks' parts
    diffs["column weight grad"] = (column.weight.grad - full.weight.grad[rows]).abs().max()
    diffs["column bias grad"] = (column.bias.grad - full.bias.grad[rows]).abs().max()

    down = nn.Linear(12, 8).double()
    h = torch.randn(3, 5, 12, dtype=torch.float64)
    w8 = torch.randn(3, 5, 8, dtype=torch.float64)
    h_full = h.clone().requires_grad_()
    down.zero_grad()
    (down(h_full) * w8).sum().backward()
    row = RowParallelLinear(down, rows, comm)
    h_row = h[..., rows].clone().requires_grad_()
    y = row(h_row)
    (y * w8).sum().backward()
    diffs["row output"] = (y - down(h)).abs().max()
    diffs["row input grad"] = (h_row.grad - h_full.grad[..., rows]).abs().max()
    diffs["row weight grad"] = (row.weight.grad - down.weight.grad[:, rows]).abs().max()
    diffs["row bias grad"] = (row.bias.grad - down.bias.grad).abs().max()

    emb = nn.Embedding(12, 4).double()
    ids = torch.randint(0, 12, (3, 5))
    e_w = torch.randn(3, 5, 4, dtype=torch.float64)
    (emb(ids) * e_w).sum().backward()
    split = VocabParallelEmbedding(emb, rows[0].item(), rows[-1].item() + 1, comm)
    out = split(ids)
    (out * e_w).sum().backward()
    diffs["embedding output"] = (out - emb(ids)).abs().max()
    diffs["embedding weight grad"] = (split.weight.grad - emb.weight.grad[rows]).abs().max()

    logits = torch.randn(15, 12, dtype=torch.float64)
    targets = torch.randint(0, 12, (15,))
    logits_full = logits.clone().requires_grad_()
    reference = F.cross_entropy(logits_full, targets)
    reference.backward()
    logits_mine = logits[:, rows].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits_mine, targets, rows[0].item(), comm)
    loss.backward()
    diffs["cross-entropy"] = (loss - reference).abs()
    diffs["cross-entropy logits grad"] = (logits_mine.grad - logits_full.grad[:, rows]).abs().max()
    return {k: float(v) for k, v in diffs.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_each_parallel_layer_equals_its_full_counterpart(tp):
    for rank in run_ranks(_layers_against_full, tp):
        bad = {k: v for k, v in rank.items() if not v <= TOL}
        assert not bad, bad


MID = {"model.n_layer": 2, "model.d_model": 32, "model.n_head": 4, "model.vocab_size": 64, "model.tie_weights": True}


def _config(world, tp, zero=0, batch_size=4, **values):
    return run_config(cli_values={"train.dtype": "float64", "train.zero": zero, "dist.nproc": world, "dist.tp": tp,
                                    "train.batch_size": batch_size, "train.log_every": 0,
                                    # between the steps' gradient norms: some steps clipped, others not
                                    "train.grad_clip": 1.5, **values})


STEPS = 5


def _run(topo, tp, zero, values):
    trainer = Trainer(_config(topo.world_size, tp, zero, **values), topo.with_layout(tp, 1))
    records = [trainer.train_step() for _ in range(STEPS)]
    # A rank holds slices of the layers; the global parameter norm after every step stands for the whole.
    return {"losses": [r.loss for r in records], "grad_norms": [r.grad_norm for r in records],
            "param_norms": [r.param_norm for r in records]}


@pytest.mark.parametrize("world,tp,zero,values", [
    (2, 2, 0, {}), (4, 4, 0, {}),  # tensor parallel alone
    (4, 2, 0, {}), (4, 2, 1, {}), (4, 2, 2, {}), (4, 2, 3, {}),  # with data parallel (dp 2) and ZeRO over it
    (2, 2, 0, MID), (4, 2, 3, MID),  # tied embedding and head share one vocabulary slice
])
def test_tensor_parallel_training_follows_one_process(world, tp, zero, values):
    reference = plain_run(_config(world, tp, batch_size=4, **values), STEPS)  # the same global batch
    assert_exercises_the_loop(reference)
    for rank, got in enumerate(run_ranks(_run, world, tp, zero, values)):
        assert_close_to(reference, TOL, f"rank {rank}", **got)


def test_layout_puts_tensor_parallel_innermost_and_pipeline_outermost():
    groups = layout_groups(8, tp=2, pp=2)  # dp = 2
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # adjacent ranks
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the farthest apart
    for kind in groups:  # every rank in exactly one group of each kind
        assert sorted(r for g in groups[kind] for r in g) == list(range(8))


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "3", "--tp", "2"], "world size 3 is not divisible by --tp 2 x --pp 1"),
    (["--nproc", "2", "--tp", "2", "--model.n_head", "1"], "--tp 2 does not divide model.n_head = 1"),
    (["--nproc", "2", "--tp", "2", "--model.d_ff", "33"], "--tp 2 does not divide the MLP width"),
    (["--nproc", "2", "--tp", "2", "--model.vocab_size", "65"], "--tp 2 does not divide model.vocab_size = 65"),
    (["--nproc", "4", "--pp", "4", "--model.n_layer", "2"], "--pp 4 needs at least one block per stage"),
])
def test_bad_layouts_exit_2_naming_the_degrees(argv, message):
    proc = run_main("train", *argv)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _saved_then_resumed(topo, root):
    cfg = _config(2, 2, 1, **MID)  # tied embedding and head, ZeRO-1
    trainer = Trainer(cfg, topo.with_layout(2, 1))
    losses = [trainer.train_step().loss for _ in range(3)]
    trainer.save_checkpoint(root)
    return losses + [trainer.train_step().loss for _ in range(2)]


def test_a_tensor_parallel_checkpoint_with_tied_weights_resumes_in_one_process(tmp_path):
    """Each rank saves its vocabulary rows of the shared embedding/head and its slices of every layer, in the
    whole model's coordinates; one process loads the whole model and continues the same run."""
    full = run_ranks(_saved_then_resumed, 2, tmp_path)[0]
    trainer = Trainer(_config(1, 1, batch_size=4, **MID), Topology.single())
    trainer.load_checkpoint(tmp_path / "step-000003")
    resumed = [trainer.train_step().loss for _ in range(2)]
    assert max(abs(a - b) for a, b in zip(resumed, full[3:])) <= TOL
