"""Imported only by the fork server that starts the launcher's ranks (launch._rank_context preloads it).

A scheduler stops a job by signalling its whole process group (`timeout`, `kill -- -PGID`, Slurm
cancelling a job), and the fork server is in that group. If it died of the SIGTERM, every rank would
die with it (a rank's parent-death signal is SIGKILL) before the ranks' agreed stop-save finished.
So the server ignores the stop signals; each rank restores their default handling as it starts
(launch._rank_main), and a training run then installs its own (resilience.StopRequest).
"""
import signal

from .resilience import STOP_SIGNALS

for _sig in STOP_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
