"""The whole model's state, and its optimizer's, put together on every rank from whatever layout holds them:
`minitrain.full_state_dict` and the prepared optimizer's `state_dict()` in torch's own format.

Trainable parameters and the optimizer's elementwise state are vectors in local layout (over a rank's shard
ranges). `gather_logical` turns such a vector into the whole model's logical vector (core/flat_parameters.py) on
every rank with one all-reduce over the world: each rank writes the elements it alone is responsible for (its
dp shard, or everything on the first replica at ZeRO-0; its tensor-parallel slices, and replicated parameters on the
first tensor-parallel rank only; its pipeline stage's parameters), zeros elsewhere, and the sum of the bit
patterns is then each element's own bits, exactly (a -0.0 or a NaN arrives as itself). Frozen parameters and
buffers follow the placement rule (placement.py): slices gathered over the tensor-parallel group, and, with
pipeline stages, each broadcast from the first stage that holds it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...runtime.comm import Comm
from .placement import check_state, dtype_name
from .slices import gather_slices

if TYPE_CHECKING:  # the strategy is handed in; whole-model state sits below the strategies
    from ..core.strategy import FlatStrategy

# The integer type of each float's width: an all-reduce of bit patterns where one rank is non-zero.
_BITS = {8: torch.int64, 4: torch.int32}


def gather_logical(strategy: FlatStrategy, local: torch.Tensor, everyone: Comm | None, dp_rank: int,
                   tp_rank: int) -> torch.Tensor:
    """The whole model's logical vector of `local` (a vector over strategy.shard_ranges), on every rank.
    Collective over `everyone`; None: this rank holds all of it (data parallel, the model whole), nothing moves."""
    flat = strategy.flat
    # A replica's elements once: at ZeRO-0 the first replica's (or this rank's own, when it alone is asked).
    ranges = strategy.checkpoint_ranges(dp_rank) if everyone is not None else strategy.shard_ranges
    wide = local.dtype if local.element_size() in _BITS else torch.float32  # 16-bit floats widen exactly
    whole = torch.zeros(flat.logical_numel, dtype=wide, device=local.device)
    for at, lo, hi in flat.pieces(ranges, replicated=tp_rank == 0) if ranges else []:
        whole[lo:hi] = local[at:at + hi - lo]
    if everyone is not None:
        everyone.all_reduce_sum(whole.view(_BITS[whole.element_size()]))
    return whole.to(local.dtype)


def full_model_state(strategy: FlatStrategy, everyone: Comm, dp: Comm, tp: Comm, pp: Comm) -> dict[str, torch.Tensor]:
    """The whole model's state_dict (its own keys, order, shapes and dtypes; copies) on every rank. Collective."""
    whole = strategy.whole
    params = gather_logical(strategy, strategy.local_params(), everyone, dp.rank, tp.rank)
    values = strategy.model.state_dict(keep_vars=True)
    held: dict[str, torch.Tensor] = {}
    for p in strategy.placements():
        if p.kind == "param":
            continue
        if p.source != p.key:  # tied to a key before it
            held[p.key] = held[p.source]
            continue
        value = values[p.key].detach()
        held[p.key] = value if p.tp_slice is None else gather_slices(value, p.tp_slice, tp)
    if pp.world_size > 1:  # the other stages' frozen parameters and buffers, each from the first stage holding it
        holders = pp.gather_json(sorted(held))
        for key, p in whole.state.items():
            if p.kind == "param":
                continue
            owner = next(stage for stage, keys in enumerate(holders) if key in keys)
            value = held[key] if pp.rank == owner else torch.empty(p.shape, dtype=p.dtype, device=params.device)
            pp.broadcast(value, src=owner)
            held[key] = value
    out, copies = {}, {}  # keys tied to one tensor share one copy, as in torch's own state_dict
    for key, p in whole.state.items():
        if p.source in copies:
            out[key] = copies[p.source].detach()
            continue
        if p.kind == "param":
            offset, numel = whole.offsets[p.source], _numel(p.shape)
            out[key] = params[offset:offset + numel].view(p.shape).clone()
        else:
            out[key] = held[key].clone()
        copies[p.source] = out[key]
    check_state(out, {k: (list(p.shape), dtype_name(p.dtype)) for k, p in whole.state.items()}, "full_state_dict")
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- the optimizer, in torch's own state_dict format -----------------------------------------------------------
def _state_kinds(strategy: FlatStrategy, everyone: Comm | None) -> tuple[list[str], dict[str, str | None]]:
    """(elementwise state names, {scalar state name: its tensor dtype or None}) over every rank: a rank whose
    shard holds no parameter, or a stage that has not stepped, may know fewer (None: this rank holds all)."""
    elementwise, scalars = strategy.optimizer._kinds()
    names: list[str] = []
    kinds: dict[str, str | None] = {}
    for theirs, their_scalars in everyone.gather_json([elementwise, scalars]) if everyone else [[elementwise, scalars]]:
        names += [n for n in theirs if n not in names]
        kinds.update(their_scalars)
    return [n for n in names if n not in kinds], kinds


def full_optimizer_state(strategy: FlatStrategy, groups: list[list[str]], everyone: Comm | None, dp_rank: int,
                         tp_rank: int) -> dict:
    """The optimizer's state_dict as torch's optimizer would give it on one process for the whole model:
    {"state": {index: {name: tensor in the parameter's shape, or scalar}}, "param_groups": [{options...,
    "params": [indices]}]}, indices counting the parameters of `groups` (canonical names, in the user's order).
    Collective over `everyone`, every rank getting the whole of it; everyone=None where this rank holds the whole
    state (data parallel, ZeRO-0, the model whole): from it alone."""
    optimizer, whole = strategy.optimizer, strategy.whole
    elementwise, scalars = _state_kinds(strategy, everyone)
    local = optimizer.state_tensors()
    full = {}
    for name in [*elementwise, *scalars]:
        vec = local.get(name)
        if vec is None:  # this rank holds none of it
            dtype = optimizer.master.dtype if name in elementwise else torch.float64
            vec = torch.zeros(optimizer.master.numel(), dtype=dtype, device=optimizer.master.device)
        full[name] = gather_logical(strategy, vec, everyone, dp_rank, tp_rank)
    state, param_groups, index = {}, [], 0
    for names, options in zip(groups, optimizer.options()):
        indices = []
        for pname in names:
            if pname not in whole.offsets:  # frozen: in the group, never stepped, no state (as in torch)
                indices.append(index)
                index += 1
                continue
            offset, shape = whole.offsets[pname], whole.state[pname].shape
            numel = _numel(shape)
            entry = {}
            for name in elementwise:
                entry[name] = full[name][offset:offset + numel].view(shape).clone()
            for name, dtype in scalars.items():
                value = float(full[name][offset]) if numel else 0.0
                entry[name] = value if dtype is None else torch.tensor(value, dtype=getattr(torch, dtype))
            if entry:
                state[index] = entry
            indices.append(index)
            index += 1
        param_groups.append({**options, "params": indices})
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state(strategy: FlatStrategy, groups: list[list[str]], state_dict: dict) -> None:
    """Restore a state_dict in torch's format (full_optimizer_state's, or a plain torch optimizer's over the same
    parameter groups): each rank takes the elements of its shard; the options of every group. Local: no rank
    talks to another. ValueError, naming what differs, for a state_dict of other groups or shapes."""
    optimizer, whole = strategy.optimizer, strategy.whole
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("load_state_dict takes an optimizer state_dict: a dict with 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"the state_dict has {len(saved_groups)} param groups, this optimizer {len(groups)}")
    params = [pname for names in groups for pname in names]
    for g, (saved, names) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(names):
            raise ValueError(f"param group {g} of the state_dict holds {len(saved['params'])} parameters, this "
                             f"optimizer's {len(names)}")
    by_index = dict(zip([i for saved in saved_groups for i in saved["params"]], params))
    if optimizer.sharded:  # a run of the shard spans parameters
        check_one_count_per_group(state_dict, {n: tuple(whole.state[n].shape) for n in whole.offsets}, by_index)
    # (A frozen parameter's state, which torch keeps for one that was trained before, has nothing to update here.)
    state = {by_index[int(i)]: entry for i, entry in state_dict["state"].items()
             if int(i) in by_index and by_index[int(i)] in whole.offsets}
    elementwise, scalars = _load_kinds(state, whole)
    device, numel = optimizer.master.device, whole.numel
    full = {name: torch.zeros(numel, dtype=optimizer.master.dtype if name in elementwise else torch.float64,
                              device=device) for name in [*elementwise, *scalars]}
    for pname, entry in state.items():
        offset, shape = whole.offsets[pname], whole.state[pname].shape
        n = _numel(shape)
        for name, value in entry.items():
            if name in elementwise:
                if tuple(value.shape) not in (tuple(shape), (1,) if shape == () else None):
                    raise ValueError(f"state '{name}' of '{pname}' has shape {list(value.shape)}, the parameter "
                                     f"{list(shape)}")
                full[name][offset:offset + n] = value.reshape(-1).to(full[name])
            else:
                full[name][offset:offset + n] = float(value)
    wanted = strategy.flat.pieces(strategy.shard_ranges)
    local = {"master": optimizer.master}
    for name, vec in full.items():
        mine = torch.zeros_like(optimizer.master, dtype=vec.dtype)
        for at, lo, hi in wanted:
            mine[at:at + hi - lo] = vec[lo:hi]
        local[name] = mine
    optimizer.load_state(local, {"steps_taken": optimizer.steps_taken, "scalars": scalars})
    optimizer.load_group_options([{k: v for k, v in group.items() if k != "params"} for group in saved_groups])


def check_one_count_per_group(state_dict: dict, trained: dict[str, tuple], by_index: dict) -> None:
    """Under ZeRO the optimizer steps a param group's parameters as runs of one vector, which share their scalar
    state (Adam's step count): a torch-format state_dict whose parameters of one group differ there (a parameter
    added or unfrozen later, one never stepped) cannot be held exactly. ValueError naming the group and the state.
    `trained`: the trainable parameters' shapes, by name (a 0-dim one's states are all 0-dim: it is left out, its
    kinds cannot be told apart here); `by_index`: index in the state_dict -> parameter name."""
    for g, group in enumerate(state_dict["param_groups"]):
        counts: dict[str, set] = {}
        indices = [i for i in group["params"] if trained.get(by_index.get(i), ())]
        for i in indices:
            entry = state_dict["state"].get(i, state_dict["state"].get(str(i), {}))
            for name, value in entry.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    counts.setdefault(name, set()).add(float(value))
        stepped = {i for i in indices if state_dict["state"].get(i, state_dict["state"].get(str(i)))}
        for name, values in counts.items():
            if len(values) > 1 or stepped and len(stepped) < len(indices):
                raise ValueError(f"param group {g}'s parameters differ in their '{name}' ({sorted(values)}, or some "
                                 "have no state): under ZeRO a group's parameters are stepped together and share it; "
                                 "give each count its own param group, or use zero=0")


def _load_kinds(state: dict[str, dict], whole) -> tuple[list[str], dict[str, str | None]]:
    """Which states of a torch-format state_dict are elementwise (a tensor shaped like its parameter) and which
    scalar (a number, or a 0-dim tensor beside a parameter that is not 0-dim), with the scalars' dtypes."""
    elementwise: list[str] = []
    scalars: dict[str, str | None] = {}
    for pname, entry in state.items():
        shape = tuple(whole.state[pname].shape)
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                scalars.setdefault(name, None)
            elif value.dim() == 0 and shape != ():
                scalars.setdefault(name, dtype_name(value.dtype))
            elif value.dim() > 0 and name not in elementwise:
                elementwise.append(name)
    for pname, entry in state.items():  # a 0-dim parameter's 0-dim states: as the other parameters say
        if tuple(whole.state[pname].shape) == ():
            for name, value in entry.items():
                if name not in scalars and name not in elementwise:
                    elementwise.append(name)
    return [n for n in elementwise if n not in scalars], scalars
