"""The error every user-input check raises, at the bottom of the layers so that any module (the runtime's topology,
the data checks, the configuration) may raise it without importing the configuration."""


class ConfigError(ValueError):
    """Bad user input. The CLI prints the message on one line and exits 2."""
