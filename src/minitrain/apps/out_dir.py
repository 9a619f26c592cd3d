"""The --out directory of a command that writes one: made and proven writable before any work, refused when it
already holds another run, locked while a run writes it."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from ..errors import ConfigError


def prepare_out_dir(path: str | Path, what: str = "output directory") -> Path:
    """Create the directory and prove it writable, or raise ConfigError."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write to {what} {out}: {e.strerror or e}") from None
    return out


def refuse_a_used_out_dir(out: Path) -> None:
    """A run without --resume starts from step 0: refuse an --out that holds another run's metrics or
    checkpoints rather than overwrite the one and mix two models in the other."""
    checkpoints = out / "checkpoints"
    saved = any(checkpoints.glob("step-*")) or os.path.lexists(checkpoints / "latest")  # not a crashed save's .tmp
    used = [name for name, there in (("metrics.jsonl", (out / "metrics.jsonl").exists()), ("checkpoints", saved))
            if there]
    if used:
        raise ConfigError(f"--out {out} already holds a run ({' and '.join(used)}); continue it with --resume auto, "
                          "or choose an empty --out")


@contextlib.contextmanager
def lock_out_dir(out: Path):
    """Hold an exclusive lock on OUT/.lock while the block runs (the kernel also drops it when the process
    ends, however it ends): two runs writing one --out would interleave their metrics and checkpoints."""
    import fcntl

    try:  # never through a symbolic link: a planted one would have the run truncate whatever it points at
        fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot open its .lock ({e.strerror or e}"
                          f"{'; it is a symbolic link: remove it' if os.path.islink(out / '.lock') else ''})") from None
    with os.fdopen(fd, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ConfigError(f"--out {out} is in use by another minitrain run ({holder}); wait for it, or choose "
                              "another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield  # closing the file at the end releases the lock
