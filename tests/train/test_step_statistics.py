"""A step's statistics as a component of their own (step_statistics.py): the parameter norm on its schedule, with
nothing else in the records changed by it; an expert load that comes through the model's spec (models/spec.py),
the trainer knowing no model family."""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from minitrain.models import spec_for
from minitrain.models.spec import ModelSpec
from minitrain.parallel.expert_parallel.load import ExpertLoad
from minitrain.runtime.topology import Topology
from minitrain.train import step_statistics
from minitrain.train import trainer as trainer_module
from minitrain.train.loop import TrainingRun
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer
from tests.helpers.dist import run_ranks

STEPS = 5
SAME = ("loss", "grad_norm", "lr", "tokens_seen", "skipped", "memory", "expert_load")


def _config(world: int = 1, **values):
    return run_config(cli_values={"model.preset": "tiny", "train.dtype": "float64", "train.steps": STEPS,
                                  "train.log_every": 0, "dist.nproc": world, **values})


def _records(topo, every: int, tp: int = 1) -> list[dict]:
    with Trainer(_config(topo.world_size, **{"dist.tp": tp}), topo.with_layout(tp, 1),
                 param_norm_every=every) as trainer:
        return [dataclasses.asdict(trainer.train_step()) for _ in range(STEPS)]


@pytest.mark.parametrize("every,computed", [(1, [1, 2, 3, 4, 5]), (2, [2, 4, 5]), (0, [5])])
def test_the_parameter_norm_is_computed_on_its_schedule_and_changes_nothing_else(every, computed):
    each, scheduled = _records(Topology.single(), 1), _records(Topology.single(), every)
    assert [r["step"] for r in scheduled if r["param_norm"] is not None] == computed  # and the last step
    for a, b in zip(each, scheduled):
        assert (b["param_norm_per_rank"] is None) == (b["param_norm"] is None)
        if b["param_norm"] is not None:  # the same figure, to the bit, where it is computed
            assert (b["param_norm"], b["param_norm_per_rank"]) == (a["param_norm"], a["param_norm_per_rank"])
        assert {k: b[k] for k in SAME} == {k: a[k] for k in SAME}


def test_under_tensor_parallelism_every_rank_computes_the_norm_at_the_same_steps():
    each, scheduled = (run_ranks(_records, 2, every, 2) for every in (1, 2))
    for rank in range(2):
        for a, b in zip(each[rank], scheduled[rank]):
            assert {k: b[k] for k in SAME} == {k: a[k] for k in SAME}
            if b["step"] in (2, 4, 5):
                assert b["param_norm_per_rank"] == a["param_norm_per_rank"] and b["comm_calls"] == a["comm_calls"]
            else:  # the norm's all-reduce over the tensor-parallel group is left out with it
                assert b["param_norm_per_rank"] is None and b["comm_calls"] < a["comm_calls"]


def test_a_run_logs_the_parameter_norm_on_the_steps_that_print_a_progress_line(tmp_path):
    TrainingRun(Topology.single(), _config(**{"train.log_every": 2, "out": str(tmp_path)})).run()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line["param_norm"] is not None] == [2, 4, 5]
    assert all(line["grad_norm"] is not None and line["loss"] is not None for line in lines)


class CountedLayer:
    """Stands for a mixture-of-experts layer: only what the trainer may know of one (models.spec.CountsExpertLoad)."""

    experts = 2

    def __init__(self, load: list[float], dropped: float, router_loss: float):
        self.load, self.dropped, self.router_loss, self.taken = load, dropped, router_loss, 0

    def take_load(self) -> ExpertLoad:
        self.taken += 1
        return ExpertLoad(self.load, self.dropped, torch.tensor(2 * self.router_loss), forwards=2)


def test_an_expert_load_comes_through_the_model_spec():
    cfg = _config()
    layers = [CountedLayer([1.0, 2.0], 0.5, 0.25), CountedLayer([3.0, 0.0], 1.0, 0.125)]
    minigpt = spec_for(cfg.model)
    spec = ModelSpec("counted", minigpt.build, minigpt.plan, expert_layers=lambda model: layers)
    with Trainer(cfg, Topology.single(), spec) as trainer:
        records = [trainer.train_step() for _ in range(2)]
    assert [r.expert_load for r in records] == [[[1.0, 2.0, 0.5], [3.0, 0.0, 1.0]]] * 2
    assert [r.router_loss for r in records] == [0.375] * 2  # the layers' sum, per forward
    assert [layer.taken for layer in layers] == [2, 2]  # taken once a step


@pytest.mark.parametrize("module", [trainer_module, step_statistics])
def test_the_step_imports_no_model_family(module):
    tree = ast.parse(Path(module.__file__).read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if "minigpt" in name], imported
