"""Stop signals: SIGTERM, SIGUSR1, SIGINT and SIGHUP become a request the run loop passes into the next step, whose
statistics exchange makes every rank agree on it (train/trainer.py); a second Ctrl-C stops at once.

(A collective that hangs fails through the collective watch and the process-group timeout; loss spikes and NaN
steps are the trainer's guards, train/guards.py.)
"""
from __future__ import annotations

import signal
import threading
import time

# SIGTERM: what schedulers send before they kill a job; SIGUSR1: what Slurm's `--signal` sends ahead of a time
# limit; SIGINT: Ctrl-C; SIGHUP: the terminal (or the ssh session) went away.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
# A Ctrl-C reaches a rank twice at once (from the terminal, and passed on by the launcher); a person's second
# Ctrl-C comes later than this.
SECOND_INTERRUPT_S = 1.0


class SecondInterrupt(KeyboardInterrupt):
    """Ctrl-C again while the first one's save was on its way: stop at once."""


class StopRequest:
    """Remembers the first stop signal this process receives (STOP_SIGNALS).

    The handler only sets a number. The trainer exchanges it with every rank at the next step
    boundary (a checkpoint is collective: all ranks must decide to save at the same step), and
    the run then saves and exits 0. A second Ctrl-C (SIGINT at least SECOND_INTERRUPT_S after the
    first) raises SecondInterrupt at once: the person wants out now, and gives up the save.
    """

    def __init__(self):
        self.signum = 0
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
            # Restart interrupted system calls (a collective blocked in recv) instead of
            # failing them with EINTR: the signal must not break the step it arrives in.
            signal.siginterrupt(sig, False)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if not self.signum:
            self.signum, self._first_at = signum, time.monotonic()
        elif signum == signal.SIGINT and time.monotonic() - self._first_at >= SECOND_INTERRUPT_S:
            raise SecondInterrupt("interrupted again: stopping at once, without the checkpoint the first stop "
                                  "signal asked for")

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
