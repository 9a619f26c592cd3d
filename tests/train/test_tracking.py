"""Tracking sinks: TensorBoard read back from its event files; the tracker's rules (a failing sink dropped, each
step once) against stand-ins. The real W&B and MLflow packages: tests/train/test_tracking_real.py."""
import importlib.machinery
import json
import math
import sys
import types

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
        id = "run-1"

        def log(self, scalars, step):
            wandb.calls.append(("log", dict(scalars), step))

        def finish(self):
            wandb.calls.append(("finish",))

    def init(**kwargs):
        wandb.calls.append(("init", kwargs))
        return Run()

    wandb.init = init
    return wandb


def test_flatten_nests_and_truncates():
    assert flatten({"a": {"b": {"c": None}}, "d": [1, 2]}) == {"a.b.c": "None", "d": "[1, 2]"}
    assert len(flatten({"long": "y" * 10_000})["long"]) == 6000


def test_check_available_names_the_missing_package(monkeypatch):
    monkeypatch.setattr("minitrain.train.tracking._installed", lambda package: package != "wandb")
    with pytest.raises(ConfigError) as err:
        check_available(log_cfg(wandb=True, tensorboard=True))
    message = str(err.value)
    assert "\n" not in message and "pip install wandb" in message and "--log.wandb" in message
    assert "tensorboard" not in message  # installed here
    check_available(log_cfg())  # nothing switched on, nothing needed


def test_a_failing_sink_is_dropped_with_one_warning(capsys):
    class Broken:
        name, run_id = "broken", "b"

        def __init__(self):
            self.closed = False

        def log(self, step, scalars):
            raise OSError("disk full")

        def close(self):
            self.closed = True

    class Recorder:
        run_id = "r"

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


def test_each_step_is_mirrored_once_and_a_resume_continues_the_same_runs(tmp_path):
    class Recorder:
        name = "recorder"

        def __init__(self, run_id):
            self.run_id, self.steps = run_id, []

        def log(self, step, scalars):
            self.steps.append(step)

        def close(self):
            pass

    first = Recorder("abc")
    tracker = Tracker([first], tmp_path / "tracking.json")
    for step in (1, 2, 3, 4, 2, 3, 5):  # steps 2-3 again, as after a rollback: mirrored once, the first time
        tracker.log_record(step_record(step))
    tracker.close()
    assert first.steps == [1, 2, 3, 4, 5]
    state = json.loads((tmp_path / "tracking.json").read_text())
    assert state == {"runs": {"recorder": "abc"}, "logged_through": 5}
    # A resume from a checkpoint of step 3 redoes 4 and 5: the same values, already in the tracker.
    again = Recorder(state["runs"]["recorder"])
    resumed = Tracker([again], tmp_path / "tracking.json", state["logged_through"])
    for step in (4, 5, 6):
        resumed.log_record(step_record(step))
    assert again.steps == [6]
