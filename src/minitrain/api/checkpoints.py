"""A prepared model's whole state: save_checkpoint / load_checkpoint (every rank writes and reads only its own
part, at any layout), and full_state_dict (the whole model in memory, with its own keys)."""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from .. import checkpoint
from ..checkpoint import CheckpointError, remote
from ..parallel.user_loop.replica_state import check_buffers_agree
from ..parallel.state.whole_state import full_model_state
from ..runtime.comm import CollectiveError
from .optimizer import PreparedOptimizer
from .session import Prepared, current, state_of


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state_dict, with exactly its own keys, shapes and dtypes, on every rank (copies): what to
    evaluate or export in memory. Put together from every data-parallel shard, tensor-parallel slice and pipeline
    stage, so it is collective (call it on every rank) and holds the whole model on each."""
    state = state_of(model)
    topo = state.topo
    current().arrive(topo.everyone, "minitrain.full_state_dict()", "it puts the model together from every rank: "
                     "call it on every rank (and use or write the result on one)")
    check_buffers_agree(state.strategy.model, topo.dp, "full_state_dict")
    return full_model_state(state.strategy, topo.everyone, topo.dp, topo.slices, topo.pp)


def save_checkpoint(directory: str | Path, model: nn.Module, optimizer: PreparedOptimizer, step: int,
                    extra: dict | None = None, staging: str | Path | None = None) -> Path | str:
    """Save the model and optimizer as a sharded, sha256-verified checkpoint under directory/step-NNNNNN,
    and point directory/latest at it once it is complete. Collective (every rank writes its own shard).
    extra: anything JSON can hold (epoch, data position, ...), returned by load_checkpoint.
    directory may be a URL of object storage (s3://bucket/prefix; checkpoint/remote/): the checkpoint is written
    in `staging` (default: a temporary directory; on several nodes, give one they share), uploaded, committed, and
    the local copy removed; returns URL/step-NNNNNN."""
    state = _with_its_optimizer(model, optimizer, "save_checkpoint")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative integer (it names the checkpoint, step-NNNNNN), got {step!r}")
    train_state = _train_state(state, step, extra)
    _arrive(state, "minitrain.save_checkpoint()", "every rank writes its own part of the checkpoint: call it on "
            "every rank")
    if remote.is_url(str(directory)):
        with _staging(staging) as local:
            step_dir = _save(local, state, step, train_state)
            remote.upload_collectively(step_dir, str(directory), state.topo)
        return f"{str(directory).rstrip('/')}/{step_dir.name}"
    return _save(directory, state, step, train_state)


def _save(directory: str | Path, state: Prepared, step: int, train_state: dict) -> Path:
    check_buffers_agree(state.strategy.model, state.topo.dp, "save_checkpoint")
    return checkpoint.save(directory, int(step), state.topo, state.strategy, train_state, {"prepare": state.settings})


def load_checkpoint(directory: str | Path, model: nn.Module, optimizer: PreparedOptimizer,
                    staging: str | Path | None = None) -> tuple[int, dict | None]:
    """Restore a checkpoint saved by save_checkpoint (the directory, or one step-NNNNNN in it) at any world
    size or ZeRO stage; each rank reads only the parts it holds. Returns (step, extra). Collective.
    directory may be a URL (its newest committed checkpoint, or URL/step-NNNNNN): fetched and verified into
    `staging` (as for save_checkpoint) first."""
    state = _with_its_optimizer(model, optimizer, "load_checkpoint")
    _arrive(state, "minitrain.load_checkpoint()", "every rank reads its own part of the checkpoint: call it on "
            "every rank")
    if remote.is_url(str(directory)):
        url, step = remote.split_step(str(directory))
        with _staging(staging) as local:
            return _load(remote.fetch_collectively(url, step, Path(local), state.topo), state)
    return _load(directory, state)


def _load(directory: str | Path, state: Prepared) -> tuple[int, dict | None]:
    saved_optimizer = checkpoint.read_manifest(checkpoint.resolve(directory))["train_state"].get("optimizer")
    if saved_optimizer is not None and saved_optimizer != _optimizer_name(state):
        raise checkpoint.CheckpointError(f"checkpoint {directory} holds the state of a {saved_optimizer}, and this "
                                         f"optimizer is a {_optimizer_name(state)}: its state would be dropped or "
                                         "missing; load it with the optimizer it was saved with")
    train_state = checkpoint.load(directory, state.topo, state.strategy)
    if train_state.get("loss_scaler") is not None and state.settings["precision"] == "fp16":
        if state.scaler is not None:
            state.scaler.load_state_dict(train_state["loss_scaler"])
        else:
            state.scaler_state = train_state["loss_scaler"]
    if "param_groups" in train_state:  # the learning rate a scheduler had set, betas, weight decay, ...
        try:
            state.strategy.optimizer.load_group_options(train_state["param_groups"])
        except ValueError as e:
            raise checkpoint.CheckpointError(f"checkpoint {directory}: {e}") from None
    return train_state["step"], train_state.get("extra")


def _arrive(state: Prepared, what: str, why: str) -> None:
    """Every rank of the prepared model at `what`, or a CheckpointError saying where each one is (nothing is written
    or read)."""
    try:
        current().arrive(state.topo.everyone, what, why)
    except CollectiveError as e:
        raise CheckpointError(f"{what} is collective: {e}") from e


@contextlib.contextmanager
def _staging(staging: str | Path | None):
    """Where a checkpoint of object storage is written or read locally: `staging` (kept), or a temporary directory
    that rank 0 makes and removes, whose name every rank gets (collective)."""
    if staging is not None:
        yield Path(staging)
        return
    topo = current().topo
    made = tempfile.mkdtemp(prefix="minitrain-staging-") if topo.is_main else None
    [path, *_] = topo.everyone.gather_json(made)
    try:
        yield Path(path)
    finally:
        topo.everyone.barrier()  # every rank done with it
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def _with_its_optimizer(model: nn.Module, optimizer, what: str) -> Prepared:
    state = state_of(model)
    if optimizer is not state.optimizer:
        raise ValueError(f"{what} takes the optimizer prepare returned with this model")
    if state.settings["servers"]:
        raise ValueError(f"{what} with prepare(servers=...) is not built yet (the servers hold the optimizer state, "
                         "which only the CLI's checkpoints fetch); full_state_dict(model) gives a worker's model")
    return state


def _train_state(state: Prepared, step: int, extra: dict | None) -> dict:
    """What a checkpoint's manifest records beside the tensors: the step, the optimizer's class, counters and group
    options, fp16's loss scaler, and the user's `extra` (refused unless strict JSON holds it: a manifest is read
    back without NaN or Infinity)."""
    optimizer = state.strategy.optimizer
    train_state = {"step": step, "optimizer_steps": optimizer.steps_taken, "optimizer_scalars": optimizer.scalar_state(),
                   "optimizer": _optimizer_name(state), "param_groups": optimizer.group_options(), "extra": extra}
    if state.settings["precision"] == "fp16":
        train_state["loss_scaler"] = state.scaler.state_dict() if state.scaler is not None else state.scaler_state
    try:
        json.dumps(train_state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint: extra must be plain JSON (dicts, lists, strings, finite numbers): {e}") \
            from None
    return train_state


def _optimizer_name(state: Prepared) -> str:
    """The user's optimizer's class, as `module.Class` (what a checkpoint records of it)."""
    cls = type(state.strategy.optimizer.inner)
    return f"{cls.__module__}.{cls.__qualname__}"
