"""Measurements run from the command line (`minitrain bench ...`)."""
from __future__ import annotations

from pathlib import Path

from ..config import ConfigError


def pyplot(what: str):
    """matplotlib.pyplot drawing to files (Agg backend), or ConfigError saying how to get it.
    Called before a measurement starts, so a missing plotting library fails it at once."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(f"{what} needs matplotlib: pip install 'minitrain[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    pyplot("saving a figure").close(fig)
