"""Where a run's settings come from: defaults < preset (model section only) < TOML file (`--config`) < command
line, coerced to each field's type (ConfigError for what cannot be)."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError
from .model import PRESETS, ModelConfig
from .schema import SECTIONS, RunConfig, field_specs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


def parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def coerce(key: str, kind: type, value):
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    try:
        if kind is bool:
            return value if isinstance(value, bool) else parse_bool(value)
        if kind is int and isinstance(value, float):
            raise ValueError("expected an integer")
        if kind in (int, float) and isinstance(value, bool):
            raise ValueError("expected a number")
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: invalid {kind.__name__} value {value!r} ({e})") from None


def load_toml(path: str | os.PathLike) -> dict[str, object]:
    """Read a TOML config into dotted keys, e.g. {'train.lr': 0.001, 'out': 'runs/x'}."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file {p}: {e}") from None
    flat: dict[str, object] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                flat[f"{key}.{sub}"] = v
        else:
            flat[key] = value
    return flat


def build_config(file_values: dict[str, object] | None = None, cli_values: dict[str, object] | None = None,
                 vocab_of: Callable[[str], int | None] | None = None) -> RunConfig:
    """Resolve defaults < preset < file < command line into a RunConfig (not yet validated). vocab_of(corpus): the
    vocabulary a tokenized corpus knows, which the model then takes unless one is given (train/run_config.py
    passes data's; None: the preset's)."""
    specs = {key: kind for key, kind, _, _ in field_specs()}
    file_values, cli_values = dict(file_values or {}), dict(cli_values or {})
    for source, values in (("config file", file_values), ("command line", cli_values)):
        unknown = sorted(set(values) - set(specs))
        if unknown:
            raise ConfigError(f"unknown setting '{unknown[0]}' in {source}; "
                              "see `minitrain train --help` for the settable fields")
    cfg = RunConfig()
    preset = cli_values.get("model.preset", file_values.get("model.preset", cfg.model.preset))
    preset = coerce("model.preset", str, preset)
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset '{preset}'; choose one of: {', '.join(PRESETS)}")
    cfg.model = ModelConfig(preset=preset, **PRESETS[preset])
    for values in (file_values, cli_values):
        for key, value in values.items():
            _set(cfg, key, coerce(key, specs[key], value))
    if "model.vocab_size" not in file_values and "model.vocab_size" not in cli_values:
        # A tokenized corpus knows its vocabulary: the model takes it, whatever the preset said.
        cfg.model.vocab_size = (vocab_of(cfg.data.corpus) if vocab_of else None) or cfg.model.vocab_size
    return cfg


def _set(cfg: RunConfig, key: str, value) -> None:
    if "." in key:
        section, name = key.split(".", 1)
        setattr(getattr(cfg, section), name, value)
    else:
        setattr(cfg, key, value)


def from_dict(values: dict) -> RunConfig:
    """Rebuild a RunConfig from `to_dict()` output (e.g. a checkpoint manifest)."""
    cfg = RunConfig(out=values.get("out", RunConfig.out))
    for name in SECTIONS:
        setattr(cfg, name, type(getattr(cfg, name))(**values.get(name, {})))
    return cfg
