"""Progress bars for work long enough to watch (tqdm, on stderr): shown only when stderr is a terminal,
so logs, pipes and tests stay clean."""
from __future__ import annotations

import sys
import threading

from tqdm import tqdm

# tqdm's own lock is a multiprocessing RLock, a named semaphore made at the first bar: a rank that is killed (a
# failed run's peers are) cannot remove it, and Python's resource tracker then warns of leaked semaphores after the
# run's one-line error. Bars here are drawn from one process's threads: a thread lock is all they need.
tqdm.set_lock(threading.RLock())

# Hashing or copying less than this takes a second or two: no bar.
LARGE_BYTES = 256 << 20


def byte_bar(total: int, desc: str, always: bool = False) -> tqdm:
    """A bar counting bytes (call .update(n)); `always` shows it for any size (on a terminal)."""
    quiet = not always and total < LARGE_BYTES
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr,
                disable=True if quiet else None)
