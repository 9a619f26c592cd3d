"""The W&B and MLflow sinks with the real packages (the `test` extra installs both): a run and its resume through the
CLI, read back with each tracker's own reader, and a tracker that breaks mid-run. MLflow writes to a SQLite store in
the run's directory, W&B offline (WANDB_MODE=offline): nothing leaves the machine."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minitrain.train.tracking import MlflowSink, Tracker, WandbSink

from tests.helpers.dist import run_cli

pytestmark = pytest.mark.slow

mlflow = pytest.importorskip("mlflow", reason="the mlflow package is not installed (pip install 'minitrain[mlflow]')")
wandb = pytest.importorskip("wandb", reason="the wandb package is not installed (pip install 'minitrain[wandb]')")

ARTIFACTS = {"config.json", "env.json", "metrics.jsonl", "summary.json"}
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""}


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    result = run_cli("train", "--preset", "tiny", "--steps", "6", "--ckpt-every-steps", "3", "--train.log_every", "0",
                     "--log.mlflow", "--log.wandb", "--log.project", "proj", "--out", str(out), *extra,
                     env=OFFLINE, timeout_s=180)
    assert result.returncode == 0, result.stderr
    return result


def _metric_lines(out: Path) -> list[dict]:
    return [line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" not in line]


def _wandb_records(out: Path) -> list[dict]:
    """Every record of every attempt's transaction log, as W&B's own reader prints them."""
    records = []
    for log in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        printed = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                                 capture_output=True, text=True, timeout=120, check=True).stdout
        records += [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    return records


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """Six steps, then the same run resumed from its step-3 checkpoint: steps 4-6 are redone."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    _train(out)
    _train(out, "--resume", str(out / "checkpoints" / "step-000003"))
    return out


def test_mlflow_holds_the_params_each_metric_step_once_and_the_run_files(resumed_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{resumed_run / 'mlflow.db'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "proj"]
    [run] = client.search_runs([experiment.experiment_id])  # the resume continued the run, no second one
    state = json.loads((resumed_run / "tracking.json").read_text())
    assert run.info.run_id == state["runs"]["mlflow"] and state["logged_through"] == 6
    config = json.loads((resumed_run / "config.json").read_text())
    assert run.data.params["train.steps"] == "6" and run.data.params["model.preset"] == config["model"]["preset"]
    losses = {line["step"]: line["loss"] for line in _metric_lines(resumed_run)}
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]  # each step once, across the resume
    assert all(m.value == pytest.approx(losses[m.step], rel=1e-12) for m in history)
    assert {m.step for m in client.get_metric_history(run.info.run_id, "train/lr")} == set(range(1, 7))
    assert ARTIFACTS <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert Path(experiment.artifact_location.removeprefix("file://")) == (resumed_run / "mlartifacts").resolve()


def test_wandb_holds_the_config_each_metric_step_once_and_the_run_files(resumed_run):
    records = _wandb_records(resumed_run)
    runs = [r["run"] for r in records if r["type"] == "run"]
    assert len(runs) == 2 and len({r["run_id"] for r in runs}) == 1  # one W&B run, continued by the resume
    assert runs[0]["run_id"] == json.loads((resumed_run / "tracking.json").read_text())["runs"]["wandb"]
    assert runs[0]["config"]["update"]["train"]["steps"] == 6
    losses = {line["step"]: line["loss"] for line in _metric_lines(resumed_run)}
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert sorted(item["_step"] for item in history) == [1, 2, 3, 4, 5, 6]
    assert all(item["train/loss"] == pytest.approx(losses[item["_step"]], rel=1e-12) for item in history)
    saved = {f["path"] for r in records if r["type"] == "files" for f in r["files"]["files"]}
    assert ARTIFACTS <= saved


def test_a_tracker_that_breaks_mid_run_is_dropped_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    broken_store = MlflowSink("proj", "r", tmp_path, {"a": 1})
    w = WandbSink("proj", "r", tmp_path, {"a": 1})
    tracker = Tracker([broken_store, w], tmp_path / "tracking.json")
    line = {"step": 1, "loss": 2.0, "lr": 1e-3}
    tracker.log_record(line)
    (tmp_path / "mlflow.db").write_bytes(b"not a database any more" * 100)  # the store breaks under the run
    for step in range(2, 5):
        tracker.log_record({**line, "step": step})
    tracker.close()
    err = capsys.readouterr().err
    assert err.count("tracking sink mlflow failed at step 2") == 1 and "dropped it" in err
    assert tracker.logged_through == 4 and not tracker.sinks
    history = [r["history"]["item"]["_step"] for r in _wandb_records(tmp_path) if r["type"] == "history"]
    assert history == [1, 2, 3, 4]  # the other sink saw every step
