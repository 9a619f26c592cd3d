"""A run's settings, typed and checked: one module per section (model.py, data.py, train.py, dist.py,
checkpoint.py, faults.py, param_server.py), put together and validated in schema.py, and where they come from
(load.py). A leaf: nothing here imports minitrain beyond errors.py."""
from ..errors import ConfigError
from .checkpoint import CheckpointConfig
from .data import DataConfig
from .dist import DDPConfig, DistConfig
from .faults import FAULT_KINDS, FaultConfig
from .fields import SEED_LIMIT, check_seed, opt
from .load import build_config, coerce, from_dict, load_toml, parse_bool
from .model import PRESETS, ModelConfig, check_model
from .schema import SECTIONS, RunConfig, field_specs
from .train import EvalConfig, LogConfig, TrainConfig, profile_range

__all__ = ["FAULT_KINDS", "PRESETS", "SECTIONS", "SEED_LIMIT", "CheckpointConfig", "ConfigError", "DDPConfig",
           "DataConfig", "DistConfig", "EvalConfig", "FaultConfig", "LogConfig", "ModelConfig", "RunConfig",
           "TrainConfig", "build_config", "check_model", "check_seed", "coerce", "field_specs", "from_dict",
           "load_toml", "opt", "parse_bool", "profile_range"]
