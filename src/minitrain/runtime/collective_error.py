"""What a failed collective raises: CollectiveError, naming the op, its bytes and this rank, and with a collective
watch (watch.py) the diagnosis every rank agrees on, which names the rank that caused it."""
from __future__ import annotations

from .diagnosis import first_sentence


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the op and this rank, and with a watch the rank
    that caused it. `culprit`: this rank is the one named (the launcher then reports its error first)."""

    def __init__(self, message: str, culprit: bool = False):
        super().__init__(message)
        self.culprit = culprit


def collective_failure(comm, op: str, nbytes: int, cause: Exception, fp: tuple | None = None) -> CollectiveError:
    """The error to raise for a collective of `comm` that raised `cause`; with a watch, it waits (a few seconds at
    most) for the diagnosis every rank agrees on and carries it."""
    where = f"{op} of {nbytes} bytes failed on rank {comm.rank} of {comm.world_size} in {comm.name}"
    watch, diagnosis = comm.watch, None
    if watch is not None:
        what = f"{op} #{fp[1]} on {comm.name}" if fp is not None else op
        diagnosis = watch.diagnose(f"collective failure (rank {watch.rank}'s {what} raised: "
                                   f"{first_sentence(cause)})", fp)
    if diagnosis is None:
        return CollectiveError(f"{where}: {cause}")
    return CollectiveError(f"{where}: {diagnosis.text}\n(the backend said: {cause})",
                           culprit=watch.rank in diagnosis.culprits)
