"""Imported only by the fork server that starts the launcher's ranks (launch._rank_context preloads it).

A scheduler stops a job by signalling its whole process group (`timeout`, `kill -- -PGID`, Slurm
cancelling a job), and the fork server is in that group. If it died of the SIGTERM, every rank would
die with it (a rank's parent-death signal is SIGKILL) before the ranks' agreed stop-save finished.
So the server ignores the stop signals, and every process forked from it (a rank, or anything else
the launcher's process starts with multiprocessing's fork server) gets their default handling back
before its target runs; a training run then installs its own (resilience.StopRequest).
"""
import multiprocessing.util
import signal

from .signals import STOP_SIGNALS


def _restore_default_handling(_registered) -> None:
    for sig in STOP_SIGNALS:  # Python's own for Ctrl-C (a KeyboardInterrupt), the system's for the others
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


class _Marker:
    """What the after-fork hook is registered on (the registry holds it weakly; this module keeps it)."""


_marker = _Marker()
multiprocessing.util.register_after_fork(_marker, _restore_default_handling)
for _sig in STOP_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
