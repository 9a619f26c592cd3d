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

Rollbacks and resumes redo steps: TensorBoard then holds two points at those steps (the later ones are the
ones metrics.jsonl keeps), W&B ignores steps below its last one, and a resume opens a new W&B/MLflow run.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Protocol

from ..errors import ConfigError

# Sink name (the --log.<name> switch) -> the package it imports.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
MLFLOW_MAX_PARAM_CHARS = 6000  # MLflow refuses longer param values

_FIELDS = {"train/loss": "loss", "train/grad_norm": "grad_norm", "train/lr": "lr",
           "train/tokens_per_s": "tokens_per_s", "train/comm_time_s": "comm_time_s",
           "val/loss": "val_loss", "val/ppl": "val_ppl"}


class Sink(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
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

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink:
    name = "wandb"

    def __init__(self, project: str, run_name: str, out_dir: Path, run_config: dict):
        import wandb

        # WANDB_MODE (online/offline/disabled) is left to the environment, as W&B users expect.
        self.run = wandb.init(project=project, name=run_name, dir=str(out_dir), config=run_config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

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

    def __init__(self, project: str, run_name: str, out_dir: Path, run_config: dict):
        import mlflow

        self.mlflow = mlflow
        # Without a tracking server the run lands next to the others of this run, not in the working directory.
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or (out_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=run_name)
        mlflow.log_params(flatten(run_config))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def open_sinks(log_cfg, out_dir: Path, run_config: dict) -> list[Sink]:
    """Start every switched-on sink (rank 0 only). If one fails to start, those already started are closed
    and the error propagates."""
    out_dir = Path(out_dir)
    run_name = log_cfg.run_name or out_dir.name
    makers = {"tensorboard": lambda: TensorBoardSink(out_dir),
              "wandb": lambda: WandbSink(log_cfg.project, run_name, out_dir, run_config),
              "mlflow": lambda: MlflowSink(log_cfg.project, run_name, out_dir, run_config)}
    sinks: list[Sink] = []
    try:
        for name, make in makers.items():
            if getattr(log_cfg, name):
                sinks.append(make())
    except BaseException:
        Tracker(sinks).close()
        raise
    return sinks


class Tracker:
    """The sinks of one run. A sink that raises is reported once on stderr and dropped (see the module
    docstring): tracking is a mirror of metrics.jsonl and must not stop training."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = list(sinks)

    @classmethod
    def open(cls, log_cfg, out_dir: Path, run_config: dict) -> Tracker:
        return cls(open_sinks(log_cfg, out_dir, run_config))

    def log_record(self, record: dict) -> None:
        """Mirror one metrics.jsonl line (event lines are skipped)."""
        scalars = scalars_of(record)
        if not scalars:
            return
        for sink in list(self.sinks):
            try:
                sink.log(record["step"], scalars)
            except Exception as e:  # noqa: BLE001 - any failure of a mirror must not stop training
                self._drop(sink, f"failed at step {record['step']}", e)

    def _drop(self, sink: Sink, what: str, error: Exception) -> None:
        self.sinks.remove(sink)
        print(f"minitrain train: warning: tracking sink {_name(sink)} {what}: {type(error).__name__}: {error}; "
              "dropped it (metrics.jsonl is unaffected)", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # release what it holds; a second error says nothing new
            sink.close()

    def close(self) -> None:
        for sink in list(self.sinks):
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - close the others; the run itself is done
                print(f"minitrain train: warning: tracking sink {_name(sink)} failed to close: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        self.sinks = []


def _name(sink: Sink) -> str:
    return getattr(sink, "name", type(sink).__name__)
