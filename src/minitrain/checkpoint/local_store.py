"""`--ckpt.dir /path` (or file:///path): the checkpoint store on a filesystem, for clusters whose machines each
have their own OUT but mount one filesystem (NFS, Lustre) for checkpoints.

remote/ treats it as any fsspec store; this filesystem makes its three writes as safe as OUT's own: a file put
into the store and `latest.json` rewritten each go to a temporary name, are fsynced and renamed into place (a crash
leaves the old file or the new one, never half of one); a commit object is created only if none exists, and only
whole (written and fsynced under a temporary name, then hard-linked to its name, which fails if the name exists).
"""
from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from .files import _fsync_dir


class DurableLocalFileSystem(LocalFileSystem):
    def _temporary(self, path: str) -> Path:
        target = Path(self._strip_protocol(path))
        target.parent.mkdir(parents=True, exist_ok=True)
        return target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part")

    def _write_synced(self, tmp: Path, data: bytes | None = None, source: str | None = None) -> None:
        with open(tmp, "wb") as out:
            if source is None:
                out.write(data)
            else:
                with open(source, "rb") as src:
                    while chunk := src.read(1 << 24):
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())

    def _replace_with(self, path: str, data: bytes | None = None, source: str | None = None) -> None:
        tmp = self._temporary(path)
        try:
            self._write_synced(tmp, data, source)
            os.replace(tmp, self._strip_protocol(path))
            _fsync_dir(tmp.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def put_file(self, lpath, rpath, **kwargs) -> None:
        self._replace_with(rpath, source=str(lpath))

    def pipe_file(self, path, value, **kwargs) -> None:
        self._replace_with(path, data=value)

    def create_only(self, path: str, data: bytes) -> None:
        """Write `path` whole, or raise FileExistsError if it exists (the store's If-None-Match: *)."""
        tmp = self._temporary(path)
        try:
            self._write_synced(tmp, data)
            try:
                os.link(tmp, self._strip_protocol(path))
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                self._create_exclusively(path, data)  # a filesystem without hard links (FUSE, SMB)
            _fsync_dir(tmp.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def _create_exclusively(self, path: str, data: bytes) -> None:
        """O_EXCL creation, then the data, fsynced: a crash between the two leaves a short commit object, which the
        store's readers refuse, naming it (remote.read_commit), rather than take a checkpoint that is not whole."""
        with open(self._strip_protocol(path), "xb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
