"""Sharded checkpoints: safetensors shards plus a JSON manifest. Data, never pickles.

Layout of OUT/checkpoints/:
  step-000010/rank-00000.safetensors   this rank's shard of the flat vectors
  step-000010/rank-00001.safetensors   (params, optim.master, optim.exp_avg,
  ...                                   optim.exp_avg_sq) and its torch, python
                                        and numpy RNG states
  step-000010/manifest.json            step, world size, strategy, model config,
                                        parameter layout, the model's state_dict
                                        keys, every tensor's file and logical
                                        pieces, every file's bytes and sha256,
                                        training state (optimizer steps, loader)
  latest                               name of the newest complete step directory

Crash safety: every rank writes into .tmp-step-000010/ and fsyncs; rank 0
writes the manifest, fsyncs, renames the directory to its final name, and
only then rewrites `latest` (itself via rename). A directory without a
verified manifest is never loaded.

A rank stores its shard as one tensor per key; the manifest lists its
*pieces*: [at, lo, hi] says elements [at, at + hi - lo) of the stored tensor
are elements [lo, hi) of the logical vector (every trainable parameter,
unpadded, in registration order; layout in the manifest). Loading reads, by
index, only the pieces this rank holds (no rank ever assembles the whole model
or optimizer), so it depends neither on how many ranks wrote them nor on the
ZeRO stage (whose per-unit padding never reaches the file's coordinates).

Everything else in the model's state_dict (frozen parameters, persistent
buffers) is stored whole, as `model.<key>`, by the first data- and
tensor-parallel rank of each pipeline stage: a frozen tensor-parallel slice is
gathered over its group first, and each rank takes its own slice back on load.
The manifest's `state_dict` maps every key of the model's own state_dict to a
trainable parameter (tied weights: two keys, one parameter) or to such a stored
tensor (a tied frozen tensor: two keys, one stored name), with the whole
model's shape and dtype for each, which is how `ckpt consolidate` writes a file
the model's load_state_dict accepts and checks it key by key. The placement
rule behind all of it: parallel/state/placement.py.
"""
from .consolidate import consolidated_state_dict
from .files import (RNG_KEYS, complete_steps, find_latest, prune, read_manifest, read_tensor, resolve, rng_state,
                    set_aside_corrupt, set_rng_state, sha256_of, verify, verify_files)
from .format import FORMAT, LATEST, MANIFEST, CheckpointError, shard_file_name, step_dir_name, step_of
from .reading import assemble_flat, load, plan_reads, read_local
from .writing import (AsyncSave, PeerSaveError, ShardWrite, begin, commit, model_entries, save, shared_by_all,
                      sharing_ranks)

__all__ = ["FORMAT", "LATEST", "MANIFEST", "RNG_KEYS", "AsyncSave", "CheckpointError", "PeerSaveError", "ShardWrite",
           "assemble_flat", "begin", "commit", "complete_steps", "consolidated_state_dict", "find_latest", "load", "model_entries", "plan_reads",
           "prune", "read_local", "read_manifest", "read_tensor", "resolve", "rng_state", "save", "set_aside_corrupt",
           "set_rng_state",
           "sha256_of", "shard_file_name", "shared_by_all", "sharing_ranks", "step_dir_name", "step_of", "verify",
           "verify_files"]
