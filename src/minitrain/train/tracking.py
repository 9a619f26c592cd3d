"""Experiment-tracking sinks: mirror chosen scalars of each metrics.jsonl step line to TensorBoard, Weights &
Biases or MLflow.

OUT/metrics.jsonl stays the source of truth; a sink is only a view of it. Each package is imported only when its
sink is switched on (`--log.tensorboard`, `--log.wandb`, `--log.mlflow`), so none of them is a dependency.

Tags (`scalars_of`), from the fields of a step line:

    train/loss                  loss
    train/grad_norm             grad_norm
    train/lr                    lr
    train/tokens_per_s          tokens_per_s
    train/comm_time_s           comm_time_s
    train/comm_share            comm_time_s / step_time_s
    memory/peak_bytes_max_rank  max over ranks of memory_peak["total"]
    val/loss                    val_loss   (only on steps that evaluated)
    val/ppl                     val_ppl    (only on steps that evaluated)

A field that is missing or None gives no scalar; an event line (one with an "event" key, e.g. a rollback) gives
none at all. The step of every scalar is the line's `step`.

Failures: a sink that cannot start raises from `open_sinks` (before training, where the user can fix it). A sink
that raises while logging or closing costs one warning line on stderr naming it and the error, and is dropped;
training and metrics.jsonl go on unaffected.

Each (scalar, step) is mirrored once. OUT/tracking.json keeps each sink's run (W&B run id, MLflow run id) and the
last step mirrored: a resumed run continues the same tracker runs and skips the steps an earlier attempt already
sent (a resume is bit-identical, so they are the same values). Steps redone after a rollback are skipped too:
the trackers keep the first values, metrics.jsonl the later ones.

At the end the run's files are logged as artifacts: config.json and env.json (what ran, on what), metrics.jsonl
and summary.json (how it went).

MLflow: MLFLOW_TRACKING_URI if set, else a SQLite store OUT/mlflow.db (MLflow's file store is deprecated) with
artifacts under OUT/mlartifacts. W&B: WANDB_MODE (online, offline, disabled) is left to the environment.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Protocol

from ..errors import ConfigError
from .run_files import write_json

# Sink name (the --log.<name> switch) -> the package it imports.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
MLFLOW_MAX_PARAM_CHARS = 6000  # MLflow refuses longer param values
STATE_FILE = "tracking.json"  # in OUT: each sink's run and the last step mirrored (see the module docstring)

_FIELDS = {"train/loss": "loss", "train/grad_norm": "grad_norm", "train/lr": "lr",
           "train/tokens_per_s": "tokens_per_s", "train/comm_time_s": "comm_time_s",
           "val/loss": "val_loss", "val/ppl": "val_ppl"}


class Sink(Protocol):
    run_id: str  # the tracker's own id of this run, to continue it after a resume

    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def log_artifacts(self, paths: list[Path]) -> None: ...
    def close(self) -> None: ...


def scalars_of(record: dict) -> dict[str, float]:
    """The tracked scalars of one metrics.jsonl line (see the module docstring); {} for an event line."""
    if "event" in record:
        return {}
    scalars = {tag: float(record[key]) for tag, key in _FIELDS.items() if record.get(key) is not None}
    comm, step_time = record.get("comm_time_s"), record.get("step_time_s")
    if comm is not None and step_time:  # a zero step time has no meaningful share
        scalars["train/comm_share"] = comm / step_time
    totals = (record.get("memory_peak") or {}).get("total")
    if totals:
        scalars["memory/peak_bytes_max_rank"] = float(max(totals))
    return scalars


def _installed(package: str) -> bool:
    # A module already in sys.modules counts (find_spec raises ValueError on one without a __spec__).
    return package in sys.modules or importlib.util.find_spec(package) is not None


def check_available(log_cfg) -> None:
    """Raise ConfigError (one line) naming each switched-on sink whose package is not installed. Does not
    import them: this runs before the launch, and wandb/mlflow are slow to import."""
    missing = [f"--log.{name} needs the {pkg} package: pip install {pkg} (or pip install 'minitrain[{name}]')"
               for name, pkg in PACKAGES.items() if getattr(log_cfg, name) and not _installed(pkg)]
    if missing:
        raise ConfigError("; ".join(missing))


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, out_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.run_id = "tensorboard"  # event files accumulate in OUT/tensorboard: nothing to reopen
        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def log_artifacts(self, paths: list[Path]) -> None:
        pass  # TensorBoard has no artifacts; the files stay in OUT beside its event files

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink:
    name = "wandb"

    def __init__(self, project: str, run_name: str, out_dir: Path, run_config: dict, run_id: str | None = None):
        import wandb

        self.out_dir = out_dir
        # WANDB_MODE (online/offline/disabled) is left to the environment, as W&B users expect.
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(project=project, name=run_name, dir=str(out_dir), config=run_config, **resume)
        self.run_id = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.run.save(str(path), base_path=str(self.out_dir), policy="now")

    def close(self) -> None:
        self.run.finish()


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """{"train": {"lr": 0.1}} -> {"train.lr": "0.1"}: MLflow params are flat strings."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)[:MLFLOW_MAX_PARAM_CHARS]
    return flat


class MlflowSink:
    name = "mlflow"

    def __init__(self, project: str, run_name: str, out_dir: Path, run_config: dict, run_id: str | None = None):
        import mlflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment(project)
        else:  # the run's own store, its artifacts beside it (MLflow's default would be the working directory)
            mlflow.set_tracking_uri(f"sqlite:///{(out_dir / 'mlflow.db').resolve()}")
            if mlflow.get_experiment_by_name(project) is None:
                mlflow.create_experiment(project, artifact_location=(out_dir / "mlartifacts").resolve().as_uri())
            mlflow.set_experiment(project)
        if run_id:  # a resume continues the run; its parameters are already there (and may not change)
            self.run_id = mlflow.start_run(run_id=run_id).info.run_id
        else:
            self.run_id = mlflow.start_run(run_name=run_name).info.run_id
            mlflow.log_params(flatten(run_config))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def log_artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.mlflow.log_artifact(str(path))

    def close(self) -> None:
        self.mlflow.end_run()


def open_sinks(log_cfg, out_dir: Path, run_config: dict, run_ids: dict[str, str] | None = None) -> list[Sink]:
    """Start every switched-on sink (rank 0 only), continuing the runs in `run_ids` (sink name -> run id). If one
    fails to start, those already started are closed and the error propagates."""
    out_dir, ids = Path(out_dir), run_ids or {}
    run_name = log_cfg.run_name or out_dir.name
    makers = {"tensorboard": lambda: TensorBoardSink(out_dir),
              "wandb": lambda: WandbSink(log_cfg.project, run_name, out_dir, run_config, ids.get("wandb")),
              "mlflow": lambda: MlflowSink(log_cfg.project, run_name, out_dir, run_config, ids.get("mlflow"))}
    sinks: list[Sink] = []
    try:
        for name, make in makers.items():
            if getattr(log_cfg, name):
                sinks.append(make())
    except BaseException:
        Tracker(sinks).close()
        raise
    return sinks


def read_state(out_dir: Path) -> dict:
    """OUT/tracking.json ({} when there is none, or it cannot be read: the trackers then start new runs)."""
    try:
        state = json.loads((Path(out_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


class Tracker:
    """The sinks of one run. A sink that raises is reported once on stderr and dropped (see the module
    docstring): tracking is a mirror of metrics.jsonl and must not stop training. With `state_path`, the sinks'
    runs and the last step mirrored are kept there, so that a resume continues them."""

    def __init__(self, sinks: list[Sink], state_path: Path | None = None, logged_through: int = 0):
        self.sinks = list(sinks)
        self.state_path, self.logged_through = state_path, logged_through
        self.run_ids = {_name(sink): sink.run_id for sink in self.sinks}
        if self.sinks and state_path is not None:
            self._save_state()

    @classmethod
    def open(cls, log_cfg, out_dir: Path, run_config: dict, resumed: bool = False) -> Tracker:
        """resumed: continue the runs OUT/tracking.json names and skip the steps they already hold."""
        state = read_state(out_dir) if resumed else {}
        sinks = open_sinks(log_cfg, out_dir, run_config, state.get("runs"))
        return cls(sinks, Path(out_dir) / STATE_FILE, int(state.get("logged_through", 0)))

    def log_record(self, record: dict) -> None:
        """Mirror one metrics.jsonl line (event lines, and steps already mirrored, are skipped)."""
        scalars = scalars_of(record)
        if not scalars or not self.sinks or record["step"] <= self.logged_through:
            return
        for sink in list(self.sinks):
            try:
                sink.log(record["step"], scalars)
            except Exception as e:  # noqa: BLE001 - any failure of a mirror must not stop training
                self._drop(sink, f"failed at step {record['step']}", e)
        self.logged_through = record["step"]
        self._save_state()

    def _save_state(self) -> None:
        if self.state_path is not None:  # a crash leaves the old state or the new, never half of one
            write_json(self.state_path, {"runs": self.run_ids, "logged_through": self.logged_through})

    def _drop(self, sink: Sink, what: str, error: Exception) -> None:
        self.sinks.remove(sink)
        print(f"minitrain train: warning: tracking sink {_name(sink)} {what}: {type(error).__name__}: {error}; "
              "dropped it (metrics.jsonl is unaffected)", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # release what it holds; a second error says nothing new
            sink.close()

    def close(self, artifacts: list[Path] = ()) -> None:
        """Log `artifacts` (those that exist) to every sink, then close them."""
        present = [Path(p) for p in artifacts if Path(p).is_file()]
        for sink in list(self.sinks):
            try:
                if present:
                    sink.log_artifacts(present)
            except Exception as e:  # noqa: BLE001 - the run itself is done; close it all the same
                print(f"minitrain train: warning: tracking sink {_name(sink)} failed to log artifacts: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - close the others; the run itself is done
                print(f"minitrain train: warning: tracking sink {_name(sink)} failed to close: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        self.sinks = []


def _name(sink: Sink) -> str:
    return getattr(sink, "name", type(sink).__name__)
