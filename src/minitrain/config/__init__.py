"""A run's settings, typed and checked (schema.py), and where they come from (load.py). A leaf: nothing here
imports minitrain beyond errors.py."""
from ..errors import ConfigError
from .load import build_config, coerce, from_dict, load_toml, parse_bool
from .schema import (FAULT_KINDS, PRESETS, SECTIONS, SEED_LIMIT, CheckpointConfig, DataConfig, DDPConfig, DistConfig,
                     EvalConfig, FaultConfig, LogConfig, ModelConfig, RunConfig, TrainConfig, check_model, check_seed,
                     field_specs, opt, profile_range)

__all__ = ["FAULT_KINDS", "PRESETS", "SECTIONS", "SEED_LIMIT", "CheckpointConfig", "ConfigError", "DDPConfig",
           "DataConfig", "DistConfig", "EvalConfig", "FaultConfig", "LogConfig", "ModelConfig", "RunConfig",
           "TrainConfig", "build_config", "check_model", "check_seed", "coerce", "field_specs", "from_dict",
           "load_toml", "opt", "parse_bool", "profile_range"]
