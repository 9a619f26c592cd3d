"""Tracking sinks: TensorBoard read back from its event files; W&B and MLflow against fakes in sys.modules
(neither package is installed here)."""
import importlib.machinery
import importlib.util
import math
import os
import sys
import types
from pathlib import Path

import pytest

from minitrain.errors import ConfigError
from minitrain.train.tracking import Tracker, check_available, flatten, open_sinks, scalars_of

RUN_CONFIG = {"model": {"n_layer": 2, "d_model": 64}, "train": {"lr": 3e-4, "steps": 3}, "note": "x" * 7000}


def step_record(step: int, val: bool = False) -> dict:
    return {"step": step, "loss": 4.0 - 0.1 * step, "grad_norm": 1.5 + step, "lr": 1e-3 * step,
            "tokens_seen": 512 * step, "tokens_per_s": 1000.0 + step, "step_time_s": 0.5, "comm_time_s": 0.1 * step,
            "memory_peak": {"params": [10, 10], "grads": [5, 5], "optimizer": [20, 20],
                            "total": [100 + step, 200 + step], "device": [0, 0]},
            "val_loss": 3.9 if val else None, "val_ppl": math.exp(3.9) if val else None}


RECORDS = [step_record(1), step_record(2, val=True), {"step": 1, "event": "rollback", "to_step": 1},
           step_record(3)]


def log_cfg(**fields):
    """The `log` section of a run config, all sinks off unless switched on here."""
    return types.SimpleNamespace(**{"tensorboard": False, "wandb": False, "mlflow": False, "project": "proj",
                                    "run_name": "", **fields})


def log_all(tracker: Tracker) -> None:
    for record in RECORDS:
        tracker.log_record(record)
    tracker.close()


def test_scalars_of_a_step_line():
    assert scalars_of(step_record(2, val=True)) == pytest.approx({
        "train/loss": 3.8, "train/grad_norm": 3.5, "train/lr": 2e-3, "train/tokens_per_s": 1002.0,
        "train/comm_time_s": 0.2, "train/comm_share": 0.4, "memory/peak_bytes_max_rank": 202.0,
        "val/loss": 3.9, "val/ppl": math.exp(3.9)})
    assert "val/loss" not in scalars_of(step_record(1))  # only steps that evaluated


def test_scalars_of_an_event_line_is_empty():
    assert scalars_of({"step": 3, "event": "rollback", "loss": 9.0, "to_step": 1}) == {}


def test_tensorboard_round_trip(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_all(Tracker.open(log_cfg(tensorboard=True), tmp_path, RUN_CONFIG))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    expected: dict[str, list] = {}
    for record in RECORDS:
        for tag, value in scalars_of(record).items():
            expected.setdefault(tag, []).append((record["step"], value))
    assert sorted(acc.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), tag  # stored as float32


def fake_module(monkeypatch, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)  # so find_spec sees it
    module.calls = []
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.fixture
def fake_wandb(monkeypatch):
    wandb = fake_module(monkeypatch, "wandb")

    class Run:
        def log(self, scalars, step):
            wandb.calls.append(("log", dict(scalars), step))

        def finish(self):
            wandb.calls.append(("finish",))

    def init(**kwargs):
        wandb.calls.append(("init", kwargs))
        return Run()

    wandb.init = init
    return wandb


@pytest.fixture
def fake_mlflow(monkeypatch):
    mlflow = fake_module(monkeypatch, "mlflow")
    for fn in ("set_tracking_uri", "set_experiment", "start_run", "log_params", "log_metrics", "end_run"):
        setattr(mlflow, fn, lambda *a, _fn=fn, **kw: mlflow.calls.append((_fn, a, kw)))
    return mlflow


def test_wandb_sink(tmp_path, fake_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run7"
    check_available(log_cfg(wandb=True))
    log_all(Tracker.open(log_cfg(wandb=True), out, RUN_CONFIG))
    calls = fake_wandb.calls
    assert calls[0] == ("init", {"project": "proj", "name": "run7", "dir": str(out), "config": RUN_CONFIG})
    assert calls[1:-1] == [("log", scalars_of(r), r["step"]) for r in RECORDS if "event" not in r]
    assert calls[-1] == ("finish",)
    assert os.environ["WANDB_MODE"] == "offline"  # left as the user set it


def test_wandb_run_name(tmp_path, fake_wandb):
    Tracker.open(log_cfg(wandb=True, run_name="named"), tmp_path, {}).close()
    assert fake_wandb.calls[0][1]["name"] == "named"


def test_mlflow_sink(tmp_path, fake_mlflow, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    check_available(log_cfg(mlflow=True))
    log_all(Tracker.open(log_cfg(mlflow=True), tmp_path / "r", RUN_CONFIG))
    names = [c[0] for c in fake_mlflow.calls]
    assert names[:4] == ["set_tracking_uri", "set_experiment", "start_run", "log_params"]
    assert names[4:] == ["log_metrics"] * 3 + ["end_run"]
    uri = fake_mlflow.calls[0][1][0]
    assert uri.startswith("file:") and Path(uri.removeprefix("file://")) == (tmp_path / "r" / "mlruns").resolve()
    assert fake_mlflow.calls[1][1] == ("proj",)
    assert fake_mlflow.calls[2][2] == {"run_name": "r"}
    params = fake_mlflow.calls[3][1][0]
    assert params == {"model.n_layer": "2", "model.d_model": "64", "train.lr": "0.0003", "train.steps": "3",
                      "note": "x" * 6000}
    metrics = [(c[1][0], c[2]) for c in fake_mlflow.calls[4:7]]
    assert metrics == [(scalars_of(r), {"step": r["step"]}) for r in RECORDS if "event" not in r]


def test_mlflow_tracking_uri_from_environment(tmp_path, fake_mlflow, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    Tracker.open(log_cfg(mlflow=True), tmp_path, {}).close()
    assert fake_mlflow.calls[0] == ("set_tracking_uri", ("http://tracker:5000",), {})


def test_flatten_nests_and_truncates():
    assert flatten({"a": {"b": {"c": None}}, "d": [1, 2]}) == {"a.b.c": "None", "d": "[1, 2]"}
    assert len(flatten({"long": "y" * 10_000})["long"]) == 6000


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_check_available_names_the_missing_package():
    with pytest.raises(ConfigError) as err:
        check_available(log_cfg(wandb=True, tensorboard=True))
    message = str(err.value)
    assert "\n" not in message and "pip install wandb" in message and "--log.wandb" in message
    assert "tensorboard" not in message  # installed here
    check_available(log_cfg())  # nothing switched on, nothing needed


def test_a_failing_sink_is_dropped_with_one_warning(capsys):
    class Broken:
        name = "broken"

        def __init__(self):
            self.closed = False

        def log(self, step, scalars):
            raise OSError("disk full")

        def close(self):
            self.closed = True

    class Recorder:
        def __init__(self):
            self.steps, self.closed = [], False

        def log(self, step, scalars):
            self.steps.append(step)

        def close(self):
            self.closed = True

    broken, good = Broken(), Recorder()
    tracker = Tracker([broken, good])
    for record in RECORDS:
        tracker.log_record(record)
    tracker.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken" in err[0] and "disk full" in err[0] and "step 1" in err[0]
    assert broken.closed and good.closed
    assert good.steps == [1, 2, 3]


def test_open_sinks_closes_the_started_ones_when_one_fails(tmp_path, fake_wandb, monkeypatch):
    def refuse(**kwargs):
        raise RuntimeError("not logged in")

    fake_wandb.init = refuse
    closed = []
    monkeypatch.setattr("minitrain.train.tracking.TensorBoardSink.close", lambda self: closed.append(True))
    with pytest.raises(RuntimeError, match="not logged in"):
        open_sinks(log_cfg(tensorboard=True, wandb=True), tmp_path, {})
    assert closed == [True]
