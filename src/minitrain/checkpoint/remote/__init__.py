"""Checkpoints on object storage: `--ckpt.dir URL` (s3://bucket/prefix, memory://, any fsspec URL), or on a filesystem
every machine mounts (`--ckpt.dir /path`: ../local_store.py).

A run still writes each checkpoint into OUT/checkpoints first (the local, crash-safe save of files.py and
writing.py); once that is complete, the ranks upload it and the checkpoint exists in the store when its commit
object does:

  URL/step-000006/<sha>/manifest.json      the step directory's files, under a prefix named after the manifest's
  URL/step-000006/<sha>/rank-00000....      sha256: a retried save of the same checkpoint writes the same objects,
  URL/step-000006.json                      a different one (after a rollback) other ones, never over committed ones
                                            the commit: {"step", "prefix", "manifest_sha256", "files": {name: bytes}},
                                            written last, create-only (If-None-Match: *), after every rank's uploads
  URL/latest.json                           {"step": 6}: the run's current checkpoint, rewritten after each commit (a
                                            run resumed from an older step makes a new line: the store's `latest`,
                                            like OUT/checkpoints/latest, says which line is the run's)

Object stores have no atomic rename, so the commit object plays the part the directory rename plays on a disk: a
step without one does not exist for resume, listing or keep_last, and its objects are swept by a later save. A
reader downloads a committed checkpoint into OUT/checkpoints (a directory of a unique name, renamed into place
once every file arrived and the whole checkpoint verified against its manifest, whose own sha256 must be the
commit's): a tampered or truncated object is refused naming it. Listings are read afresh (fsspec's listing cache
invalidated) every time.

Where each machine has a disk of its own (OUT not shared), a machine's OUT/checkpoints holds its own ranks' files
and the manifest: each rank uploads its file, rank 0 the manifest, and once committed a machine's partial copy is
removed; the checkpoint exists whole in the store only, and a resume fetches it onto every machine.

A failed upload leaves the previous committed checkpoint as it was.

client.py reaches the store (and retries), commits.py says what a checkpoint is there and reads it back,
transfer.py moves one checkpoint up or down in one process, collective.py does it with every rank of a run.
"""
from . import client, collective, commits, transfer
from .client import check_location, is_local, is_url, s3_filesystem_class, store
from .collective import Upload, fetch_collectively, fetch_each, upload_collectively
from .commits import LATEST_NAME, committed_steps, latest_step, listing, read_commit
from .transfer import commit_upload, fetch, local_copy, newest_locally, split_step, sweep, upload_files

__all__ = ["LATEST_NAME", "Upload", "check_location", "client", "collective", "commit_upload", "commits",
           "committed_steps", "fetch", "fetch_collectively", "fetch_each", "is_local", "is_url", "latest_step",
           "listing", "local_copy", "newest_locally", "read_commit", "s3_filesystem_class", "split_step", "store",
           "sweep", "transfer", "upload_collectively", "upload_files"]
