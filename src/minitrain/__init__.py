"""minitrain: a small, readable, exactly correct distributed trainer for GPT-style models."""

__version__ = "0.1.0"
