"""What every section of the settings is made of: opt(), a field carrying the help text that `minitrain train
--help` prints, and the checks that raise ConfigError with a sentence naming the field that is wrong."""
from __future__ import annotations

from dataclasses import field

from ..errors import ConfigError


def opt(default, help: str):
    """A config field with its help text (shown by --help)."""
    return field(default=default, metadata={"help": help})


def require_positive(name: str, value) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")


def require_non_negative(name: str, value) -> None:
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")


def require_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


SEED_LIMIT = 2 ** 63  # numpy's and torch's generators take seeds in [0, 2^63) everywhere


def check_seed(flag: str, value) -> None:
    """A seed every generator of the run accepts: 0 <= seed < 2^63 (ConfigError, one line, before anything runs)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"{flag} must be an integer in [0, 2^63), got {value}")
