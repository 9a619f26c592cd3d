"""The error every user-input check raises, in a module of its own so that any module may raise it without
importing the configuration (config imports data and faults to validate a run; they must not import it back)."""


class ConfigError(ValueError):
    """Bad user input. The CLI prints the message on one line and exits 2."""
