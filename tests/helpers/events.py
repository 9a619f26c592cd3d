"""Waiting for what a run does rather than for wall time: a deadline of stillness, which starts again whenever the
run writes something, so that a loaded machine's slow progress is waited for and only a run that stopped moving
fails."""
from __future__ import annotations

import os
import time
from pathlib import Path


def written(*roots: Path) -> int:
    """The bytes of every file under `roots` (logs, metrics, checkpoints): it grows while a run makes progress. A file
    or directory renamed or removed while it is listed (a checkpoint's .tmp- directory) is passed over."""
    total = 0
    for root in roots:
        for directory, _, files in os.walk(root, onerror=lambda _error: None):
            for name in files:
                try:
                    total += os.stat(os.path.join(directory, name)).st_size
                except OSError:
                    continue
    return total


def until(what: str, condition, quiet_s: float, activity, on_timeout=lambda: None):
    """Poll condition() until it gives something true, and return that. TimeoutError naming `what` once activity()
    has not changed for quiet_s seconds (on_timeout() first: kill what would otherwise outlive the test)."""
    seen, still_since = activity(), time.monotonic()
    while True:
        value = condition()
        if value:
            return value
        now = activity()
        if now != seen:
            seen, still_since = now, time.monotonic()
        elif time.monotonic() - still_since > quiet_s:
            on_timeout()
            raise TimeoutError(f"no {what}, and nothing written for {quiet_s:g} s")
        time.sleep(0.1)
