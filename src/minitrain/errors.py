"""The error every user-input check raises, at the bottom of the layers so that any module (the runtime's topology,
the data checks, the configuration) may raise it without importing the configuration."""


class ConfigError(ValueError):
    """Bad user input. The CLI prints the message on one line and exits 2: a line break inside a value it quotes
    (a preset or a path given with one) is shown escaped, not broken."""

    def __init__(self, message: str, *args):
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"), *args)
