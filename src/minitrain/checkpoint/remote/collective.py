"""Every rank of a run taking part in one store operation: the ranks' shares of a checkpoint uploaded (in a
background thread when asked), then committed by rank 0 once every share is up; a committed checkpoint fetched
onto every rank's disk, or by rank 0 for all. A failure on any rank is gathered and raised on every rank, so no
rank is left waiting in a collective the others skipped."""
from __future__ import annotations

import contextlib
import shutil
import sys
import threading
from pathlib import Path

from ..files import read_manifest
from ..format import LATEST, MANIFEST, MANIFEST_SHA, CheckpointError, shard_file_name, step_dir_name
from . import transfer  # called through the module, so a test can stand a slow store in for it
from .commits import latest_step


class Upload:
    """One checkpoint of OUT/checkpoints going up to the store: this rank's share of its files (one directory for
    all: the files dealt out; each machine its own disk: each rank's own file, and rank 0's the manifest, which
    writing.commit gave every machine), in a background thread when asked; then commit() (collective) writes the
    commit object once every rank's share is up."""

    def __init__(self, step_dir: Path, url: str, topo, keep_last: int = 0, background: bool = False):
        """Collective (every rank says whether its copy is whole)."""
        self.step_dir, self.url, self.topo, self.keep_last = Path(step_dir), url, topo, keep_last
        self.whole = topo.everyone.gather_json(_whole(self.step_dir))
        names = sorted(p.name for p in self.step_dir.iterdir())
        self.mine = (names[topo.rank::topo.world_size] if all(self.whole) else
                     [shard_file_name(topo.rank)] + ([MANIFEST, MANIFEST_SHA] if topo.is_main else []))
        self.error: str | None = None
        self._done = threading.Event()
        if background:
            threading.Thread(target=self._upload, name=f"upload-{self.step_dir.name}", daemon=True).start()
        else:
            self._upload()

    def _upload(self) -> None:
        self.error = _failure(lambda: transfer.upload_files(self.step_dir, self.url, self.mine))
        self._done.set()

    @property
    def written(self) -> bool:
        """This rank's share is up (or failed): commit would not wait for it."""
        return self._done.is_set()

    def commit(self) -> Path:
        """Collective: once every rank's share is up, rank 0 commits the checkpoint in the store and sweeps what no
        commit names (and all but keep_last); a machine's partial copy then goes. A failure anywhere raises
        CheckpointError on every rank, naming the object; what was committed before stays. Returns the step
        directory (gone where it held a machine's share only)."""
        self._done.wait()
        everyone, name = self.topo.everyone, self.step_dir.name
        _raise_if_any(everyone.gather_json(self.error), f"uploading {name} to {self.url}")
        error = _failure(lambda: transfer.commit_upload(self.step_dir, self.url)) if self.topo.is_main else None
        _raise_if_any(everyone.gather_json(error), f"committing {name} in {self.url}")
        if not self.whole[self.topo.rank]:  # a machine's share of a checkpoint resumes nothing: the store has it
            _forget(self.step_dir)
        if self.topo.is_main:  # the checkpoint is committed; leftovers that stay are swept by a later save
            swept = _failure(lambda: transfer.sweep(self.url, self.keep_last))
            if swept:
                print(f"minitrain: warning: sweeping {self.url} after committing {name}: {swept}", file=sys.stderr,
                      flush=True)
        return self.step_dir


def upload_collectively(step_dir: Path, url: str, topo, keep_last: int = 0) -> Path:
    """Collective: Upload, at once (see there)."""
    return Upload(step_dir, url, topo, keep_last).commit()


def _forget(step_dir: Path) -> None:
    """Remove a machine's share of a checkpoint, and `latest` where it names it."""
    latest = step_dir.parent / LATEST
    with contextlib.suppress(OSError):
        if latest.read_text().strip() == step_dir.name:
            latest.unlink()
    shutil.rmtree(step_dir, ignore_errors=True)


def fetch_each(url: str, step: int, local_root: Path, topo) -> Path:
    """Collective: the committed checkpoint of `step` on every rank's disk (fetch: kept where a whole copy verifies,
    downloaded elsewhere, e.g. on machines whose OUT is their own); CheckpointError on every rank if a rank cannot."""
    error = _failure(lambda: transfer.fetch(url, step, local_root))
    _raise_if_any(topo.everyone.gather_json(error), f"fetching {step_dir_name(step)} from {url}")
    return Path(local_root) / step_dir_name(step)


def fetch_collectively(url: str, step: int | None, local_root: Path, topo) -> Path:
    """Collective: rank 0 fetches the checkpoint of `step` (None: the newest committed) into local_root, which every
    rank reads (on several nodes, a filesystem they share, as for every checkpoint); CheckpointError on every rank
    if it cannot."""
    fetched = None
    if topo.is_main:
        try:
            if step is None:
                step = latest_step(url)
                if step is None:
                    raise CheckpointError(f"no committed checkpoint under {url}")
            fetched = str(transfer.fetch(url, step, local_root))
        except Exception as e:  # noqa: BLE001 - the other ranks wait for word of it in the gather below
            fetched = {"error": str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"}
    [fetched, *_] = topo.everyone.gather_json(fetched)
    if isinstance(fetched, dict):
        raise CheckpointError(fetched["error"])
    return Path(fetched)


def _failure(action) -> str | None:
    """None if action() went through, else what went wrong (every rank must hear of it: the caller gathers it, so
    nothing may escape past that collective)."""
    try:
        action()
    except Exception as e:  # noqa: BLE001 - whatever it was, the other ranks wait for word of it
        return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    return None


def _raise_if_any(errors: list[str | None], what: str) -> None:
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, first = failed[0]
        raise CheckpointError(f"{what}: rank {rank}: {first}")


def _whole(step_dir: Path) -> bool:
    """step_dir holds every file its manifest names (not only this machine's ranks')."""
    return all((step_dir / entry["name"]).is_file() for entry in read_manifest(step_dir)["files"])
