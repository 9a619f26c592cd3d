"""The run's settings as a whole: RunConfig, one field per section (each section in its own module, every field
with the help text `minitrain train --help` prints), field_specs() listing every settable key, and
`RunConfig.validate()`, which checks what the settings say by themselves, section by section, and raises
ConfigError with a sentence a user can act on. What needs more than the settings (the corpus on disk, an
installed tracking package) is checked by train/run_config.py.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from ..errors import ConfigError
from .checkpoint import CheckpointConfig, check_checkpoint
from ..utils.object_store import is_url
from .data import DataConfig, check_data
from .dist import DDPConfig, DistConfig, check_distributed, check_sync
from .faults import FaultConfig, check_fault
from .fields import check_seed, opt
from .model import ModelConfig, check_model
from .param_server import ParameterServerConfig, check_parameter_servers
from .train import (EvalConfig, LogConfig, TrainConfig, check_batch, check_eval, check_guards, check_optimizer,
                    check_precision, profile_range)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    ps: ParameterServerConfig = field(default_factory=ParameterServerConfig)
    out: str = opt("runs/train", "directory for everything the run writes: metrics.jsonl, checkpoints/")

    def validate(self) -> "RunConfig":
        """Every setting checked by what it says alone (the batch derived from --global-batch on the way);
        ConfigError names the first that is wrong."""
        _check_finite(self)
        check_model(self.model)
        check_batch(self)
        check_sync(self)
        check_precision(self.train)
        check_optimizer(self.train)
        check_distributed(self)
        _check_run(self)
        check_parameter_servers(self)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def data_parallel_ranks(self) -> int:
        """The ranks that each read their own share of a batch: the world / (tp x pp), less parameter servers."""
        d = self.dist
        return (d.nproc - self.ps.servers) // (d.tp * d.pp)


def _check_finite(cfg: RunConfig) -> None:
    for key, kind, _, _ in field_specs():  # NaN passes every comparison the sections make; inf overflows later
        value = _get(cfg, key)
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")


def _check_run(cfg: RunConfig) -> None:
    """What the run writes and watches: profiling, checkpoints, guards, faults, seeds, --out, evaluation."""
    t = cfg.train
    profile_range(t.profile_steps, t.steps)
    check_checkpoint(cfg.ckpt, cfg.out)
    check_guards(t)
    check_fault(cfg.fault, cfg.dist.nproc)
    check_seed("--seed", t.seed)
    check_data(cfg.data)
    if cfg.data.store_timeout_s >= cfg.dist.timeout_s and any(is_url(c) for c in cfg.data.corpus.split(",")):
        raise ConfigError(f"--data.store_timeout_s {cfg.data.store_timeout_s:g} must be less than --dist.timeout_s "
                          f"{cfg.dist.timeout_s:g}: the other ranks wait for a rank waiting for its data, and the "
                          "process group would time out first (0 takes 80% of it)")
    if not cfg.out.strip():
        raise ConfigError("--out is empty; name the directory the run writes to (e.g. --out runs/mine)")
    check_eval(cfg.eval)


SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig) if f.name != "out"}


def field_specs() -> list[tuple[str, type, object, str]]:
    """(dotted key, type, default, help) for every settable field, in declaration order."""
    specs = []
    for section in dataclasses.fields(RunConfig):
        if section.name == "out":
            specs.append(("out", str, section.default, section.metadata["help"]))
            continue
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            specs.append((f"{section.name}.{f.name}", hints[f.name], f.default, f.metadata["help"]))
    return specs


def _get(cfg: RunConfig, key: str):
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)
