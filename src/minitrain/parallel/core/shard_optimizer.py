"""A user's own torch optimizer, run on this rank's part of the flat parameters.

`TorchShardOptimizer` is what `minitrain.prepare` hands the strategies as their optimizer. It
builds the user's optimizer (any `torch.optim.Optimizer` class, called like one) on views of
the master vector: at data parallel one view per parameter, shaped like it, so any optimizer
works; under ZeRO one flat view per run of the rank's shard that belongs to one param group,
so each group keeps its own options (no weight decay for biases and norms, say) whatever the
stage. The optimizer updates the views in place, i.e. the master; the strategy then publishes
the master as the parameters.

Sharding an optimizer over arbitrary slices of its parameters is exact only if it is
elementwise: the update of each element depends on that element's gradient and state alone
(SGD, Adam, AdamW, RMSprop, ... and a user's own subclass written that way). One that looks at
a whole tensor (Adafactor's row and column statistics, Muon's orthogonalisation, LBFGS) would
silently compute something else, so `check_elementwise` runs the user's optimizer on a small
probe, whole and cut into pieces, and refuses it under ZeRO when the two disagree.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from .offload import OffloadStore, copy_converting_on_device
from .piece_vector import PieceVector
from .flat_parameters import FlatParameters, Ranges

OptimizerFn = Callable[..., torch.optim.Optimizer]


class NotElementwiseError(ValueError):
    """The optimizer's update of an element depends on more than that element: it cannot be sharded."""


def check_optimizer_fn(optimizer_fn: OptimizerFn, options: dict) -> None:
    """Refuse, at every stage, what prepare cannot make an optimizer of: something not callable, or an optimizer
    whose step re-evaluates the loss (step(closure): minitrain's step is one update from the gradients of the
    backward before it). (An optimizer already made comes here as its maker: api/user_optimizer.py.)"""
    if not callable(optimizer_fn):
        raise ValueError(f"the optimizer is a {type(optimizer_fn).__name__}: pass a torch optimizer made over the "
                         "model's parameters, or what makes one from param groups, e.g. "
                         "functools.partial(torch.optim.AdamW, lr=1e-3)")
    try:
        probe = optimizer_fn([{"params": [torch.zeros(2, 2, requires_grad=True)], **options}])
    except Exception:  # noqa: BLE001 - one that takes only some tensors says so itself when prepare makes it
        return
    closure = inspect.signature(probe.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"{type(probe).__name__}.step(closure) evaluates the loss itself, as often as it needs; "
                         "minitrain's step is one update from the gradients of the backward before it: use an "
                         "optimizer that steps from gradients (SGD, Adam, AdamW, ...)")


ZERO_SHARDS = ("ZeRO cannot shard it", "use zero=0, which gives it whole parameters")


def check_elementwise(optimizer_fn: OptimizerFn, options: dict, cut: tuple[str, str] = ZERO_SHARDS) -> None:
    """Raise NotElementwiseError unless optimizer_fn gives the same update to a (6, 5) tensor whole and cut
    into three flat pieces, over three steps with the same gradients (float64, random values). cut: (what cannot
    cut it, what to do instead), for the message."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    grads = [torch.randn(6, 5, generator=gen, dtype=torch.float64) for _ in range(3)]
    whole = start.clone()
    pieces = [p.clone() for p in start.reshape(-1).split([7, 13, 10])]
    try:
        opt_whole = optimizer_fn([{"params": [whole], **options}])
        if opt_whole.param_groups[0].get("capturable"):
            # A capturable optimizer keeps its step on the device, which the probe's host tensors cannot; whether
            # it is elementwise does not depend on where the step is kept.
            options = {**options, "capturable": False}
            opt_whole = optimizer_fn([{"params": [whole], **options}])
        opt_pieces = optimizer_fn([{"params": pieces, **options}])
        for g in grads:
            whole.grad = g.clone()
            for p, gp in zip(pieces, g.reshape(-1).split([7, 13, 10])):
                p.grad = gp.clone()
            opt_whole.step()
            opt_pieces.step()
    except Exception as e:  # noqa: BLE001 - any failure on plain tensors means it cannot run on a shard
        raise NotElementwiseError(f"{_name(optimizer_fn)} could not be run on a piece of the parameters "
                                  f"({type(e).__name__}: {e}), so {cut[0]}; {cut[1]}") from e
    diff = float((whole.reshape(-1) - torch.cat(pieces)).abs().max())
    if not diff <= 1e-12 * max(1.0, float(whole.abs().max())):
        raise NotElementwiseError(f"{_name(optimizer_fn)} is not elementwise (a tensor cut into pieces is updated "
                                  f"differently from the whole, by up to {diff:.2e}), so {cut[0]}; {cut[1]}")


def _name(optimizer_fn) -> str:
    fn = getattr(optimizer_fn, "func", optimizer_fn)  # functools.partial
    return getattr(fn, "__name__", repr(fn))


def group_runs(flat: FlatParameters, shard_ranges: Ranges, groups: list[list[str]]) -> list[list[tuple[int, int]]]:
    """For each group (a list of parameter names), the local [start, stop) runs of the shard it owns. Every
    local element belongs to exactly one group: padding goes with the parameter before it (or the first
    group), so the optimizer's state covers the whole shard, as the memory math counts it."""
    local_len = sum(b - a for a, b in shard_ranges)
    owner = torch.zeros(local_len, dtype=torch.long)  # group of each local element; padding is filled in below
    known = torch.zeros(local_len, dtype=torch.bool)
    for g, names in enumerate(groups):
        for a, b in flat.local_ranges(flat.ranges_of_names(names), shard_ranges):
            owner[a:b], known[a:b] = g, True
    # Padding takes the group of the nearest known element before it (forward fill), or group 0.
    last_known = torch.where(known, torch.arange(local_len), -1).cummax(0).values if local_len else owner
    owner = torch.where(last_known >= 0, owner[last_known.clamp(min=0)], 0)
    runs: list[list[tuple[int, int]]] = [[] for _ in groups]
    if local_len:
        cuts = [0, *((owner[1:] != owner[:-1]).nonzero().flatten() + 1).tolist(), local_len]
        for a, b in zip(cuts[:-1], cuts[1:]):
            runs[int(owner[a])].append((a, b))
    return runs


_SKIP = object()
_NOT_OPTIONS = ("params", "param_names")  # what a param group holds besides its options


def _json_option(value):
    """An optimizer option as JSON, or _SKIP if JSON cannot hold it."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        items = [_json_option(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _SKIP


class TorchShardOptimizer:
    """The strategies' optimizer interface (as FlatAdamW) over a user's torch optimizer.

    master: this rank's local vector; views: the tensors the torch optimizer sees, each with its
    local [start, stop) range."""

    def __init__(self, master: torch.Tensor, flat: FlatParameters, shard_ranges: Ranges, sharded: bool,
                 optimizer_fn: OptimizerFn, groups: list[tuple[list[str], dict]], store: OffloadStore | None = None,
                 shown: list[dict] | None = None):
        """store: where the master and the optimizer's elementwise state live when offloaded (offload.py). The
        torch optimizer makes its state at its first step, where the master is; it then moves into the store.
        shown: the param groups the user sees (PreparedOptimizer.param_groups, over the model's parameters; prepare
        fills the list once the model is split), one per group: their options are the ones that count, taken into
        the torch optimizer's own groups at each step, saved and loaded (a scheduler writes its lr there)."""
        self.store, self.sharded = store, sharded
        self.shown = shown if shown is not None else []
        self._stored: dict[str, torch.Tensor] = {}  # offloaded: each elementwise state, one vector over the master
        self.master, self.steps_taken = (master if store is None else store.copy_of("master", master)), 0
        master = self.master
        self.views: list[tuple[torch.Tensor, int, int]] = []
        param_groups = []
        if not sharded:  # every parameter whole, in its own shape: any optimizer works
            by_name = {s.name: s for s in flat.segments}
            for names, options in groups:
                views = []
                for name in names:
                    s = by_name.get(name)
                    if s is None:  # on another pipeline stage
                        continue
                    # A 0-dim parameter is seen as one element of shape (1,): its state stays a tensor like it
                    # (not a scalar such as Adam's step), so it is saved and resharded as elementwise state.
                    views.append(master[s.offset:s.offset + s.numel].view(s.shape or (1,)))
                    self.views.append((views[-1], s.offset, s.offset + s.numel))
                param_groups.append({"params": views, **options})
        else:
            for (names, options), runs in zip(groups, group_runs(flat, shard_ranges, [n for n, _ in groups])):
                views = [master[a:b] for a, b in runs]
                self.views += [(v, a, b) for v, (a, b) in zip(views, runs)]
                param_groups.append({"params": views, **options})
        self.views.sort(key=lambda v: v[1])
        self.inner = optimizer_fn(param_groups)
        for shown, own in zip(self.shown, self.inner.param_groups):  # every option, as a torch optimizer's groups have
            for key, value in own.items():
                if key not in _NOT_OPTIONS:
                    shown.setdefault(key, value)
        self._group_of = {id(view): group for group in self.inner.param_groups for view in group["params"]}
        # Where each view's scalar state (Adam's step) is read back from a checkpoint's vector: its first element
        # that is a parameter's, not padding (which a checkpoint does not hold, and loads as zero).
        real = flat.local_ranges([(s.offset, s.offset + s.numel) for s in flat.segments], shard_ranges)
        self._scalar_at = [min((max(a, lo) for lo, hi in real if lo < b and hi > a), default=None)
                           for _, a, b in self.views]

    @torch.no_grad()
    def step(self, grad: torch.Tensor | PieceVector, lr: float | None, grad_scale: float = 1.0,
             publish_to: torch.Tensor | None = None) -> None:
        """Update the master from `grad` (local layout; ZeRO-2/3's pieces, piece_vector.py) times grad_scale
        (clipping, unscaling); then copy it to `publish_to` where given (FlatAdamW.step's: a torch optimizer
        steps all its tensors in one call, so the copy follows it whole)."""
        if self.store is not None:
            self.store.check()  # a file truncated under its mapping: one clear error, not SIGBUS below
        for view, a, b in self.views:
            g = grad[a:b].to(self.master.dtype)  # mixed precision: widened
            if grad_scale != 1.0:
                g.mul_(grad_scale)  # in place: the caller is done with its gradient buffer
            view.grad = g.view_as(view)
        self._take_options()
        if lr is not None:
            for group in self.inner.param_groups:
                group["lr"] = lr
        self.inner.step()
        for view, _, _ in self.views:
            view.grad = None
        self.steps_taken += 1
        self._offload_state()
        if publish_to is not None:
            copy_converting_on_device(publish_to, self.master)

    def release_pages(self) -> None:
        """Disk offload: once the strategy has published the master, the state's pages go back to the kernel (the
        files keep them). A torch optimizer steps all its tensors in one call: they are resident during it."""
        if self.store is not None:
            self.store.release()

    @torch.no_grad()
    def _offload_state(self) -> None:
        """Offloaded: put each elementwise state the optimizer made where it was (at its first step, or by a load)
        into one vector of the store, the optimizer keeping views of it; the same values, elsewhere."""
        if self.store is None:
            return
        for name in self._kinds()[0]:
            for view, a, b in self.views:
                value = self.inner.state.get(view, {}).get(name)
                if value is None:
                    continue
                if name not in self._stored:
                    self._stored[name] = self.store.zeros(name, self.master.numel(), value.dtype)
                held = self._stored[name][a:b].view_as(value)
                if value.data_ptr() != held.data_ptr():
                    held.copy_(value)
                    self.inner.state[view][name] = held

    # --- the param groups' options (lr, betas, momentum, weight decay, a scheduler's initial_lr) ----------------
    def _groups(self) -> list[dict]:
        """The groups whose options count: the user's (shown), or the torch optimizer's own."""
        return self.shown or self.inner.param_groups

    def _take_options(self) -> None:
        """The options of the groups the user sees, into the torch optimizer's own groups."""
        for shown, own in zip(self.shown, self.inner.param_groups):
            for key, value in shown.items():
                if key not in _NOT_OPTIONS:
                    own[key] = value

    def options(self) -> list[dict]:
        """Every param group's options (all it holds but its parameters), as they are now."""
        return [{k: v for k, v in group.items() if k != "params"} for group in self._groups()]

    def group_options(self) -> list[dict]:
        """Every param group's options as JSON (a tuple as a list, a 1-element tensor as its number); options JSON
        cannot hold (a callable) are left out, and so are the parameters' names."""
        return [{k: _json_option(v) for k, v in group.items() if k not in _NOT_OPTIONS and _json_option(v) is not _SKIP}
                for group in self._groups()]

    def load_group_options(self, saved: list[dict]) -> None:
        """Restore what group_options() gave, each option in the type it has now (a tuple stays a tuple, a tensor
        a tensor, filled in place)."""
        groups = self._groups()
        if len(saved) != len(groups):
            raise ValueError(f"{len(saved)} param groups were saved; this optimizer has {len(groups)}")
        for group, options in zip(groups, saved):
            for key, value in ((k, v) for k, v in options.items() if k not in _NOT_OPTIONS):
                current = group.get(key)
                if isinstance(current, torch.Tensor):
                    current.fill_(value)
                elif isinstance(current, tuple):
                    group[key] = tuple(value)
                else:
                    group[key] = value
        self._take_options()

    # --- state: every state as a vector in local layout, so that it reshards like the parameters -------------
    def _kinds(self) -> tuple[list[str], dict[str, str | None]]:
        """(names of elementwise state, {name of scalar state: its tensor dtype, or None for a number}), from the
        state the optimizer holds now."""
        elementwise, scalar = [], {}
        for view, _, _ in self.views:
            for name, value in self.inner.state.get(view, {}).items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    scalar.setdefault(name, str(value.dtype).removeprefix("torch.")
                                      if isinstance(value, torch.Tensor) else None)
                elif value.shape == view.shape:
                    if name not in elementwise:
                        elementwise.append(name)
                else:
                    raise NotElementwiseError(f"{type(self.inner).__name__} keeps state '{name}' of shape "
                                              f"{tuple(value.shape)} for a parameter of shape {tuple(view.shape)}: "
                                              "only elementwise or scalar optimizer state can be checkpointed")
        return elementwise, scalar

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The master and every state as a vector in local layout (new tensors, but the master). A scalar state
        (Adam's step) is spread over its parameter's elements, in float64 (exact for counts), so that any
        rank of any layout finds the value of the parameters it holds."""
        elementwise, scalar = self._kinds()
        out = {"master": self.master}
        if self.store is not None:
            self.store.check()
        for name in [*elementwise, *scalar]:
            stored = self._stored.get(name)
            if stored is not None and stored.dtype == self.master.dtype:  # offloaded: that vector, not a copy
                out[name] = stored
                continue
            vec = torch.zeros(self.master.numel(), dtype=self.master.dtype if name in elementwise else torch.float64,
                              device=self.master.device)
            for view, a, b in self.views:
                value = self.inner.state.get(view, {}).get(name)
                if value is not None:
                    vec[a:b] = value.reshape(-1) if name in elementwise else float(value)
            out[name] = vec
        return out

    def _scalar_device(self, view: torch.Tensor) -> torch.device:
        """Where torch keeps a parameter's scalar state (Adam's step): on its device for a capturable or fused
        optimizer (the step stays on the device), on the host otherwise."""
        group = self._group_of[id(view)]
        return view.device if group.get("capturable") or group.get("fused") else torch.device("cpu")

    def elementwise_states(self) -> int:
        """State tensors per element besides the master (AdamW: 2, SGD with momentum: 1), once it has stepped."""
        return len(self._kinds()[0])

    def held_tensors(self) -> list[torch.Tensor]:
        """The master and the optimizer's elementwise state tensors (scalars such as Adam's step are not counted)."""
        held = [self.master]
        for view, _, _ in self.views:
            held += [v for v in self.inner.state.get(view, {}).values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0]
        return held

    def scalar_state(self) -> dict:
        """How to rebuild the scalar states from their vectors: {name: tensor dtype, or None for a number}."""
        return {"steps_taken": self.steps_taken, "scalars": self._kinds()[1]}

    @torch.no_grad()
    def load_state(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        self.master.copy_(tensors["master"])
        dtypes = scalars.get("scalars", {})
        for name in tensors:  # each vector read once (a checkpoint's are read when asked for, one at a time)
            if name == "master":
                continue
            vec = tensors[name]
            for (view, a, b), at in zip(self.views, self._scalar_at):
                if at is None:
                    continue  # an empty piece of a group, or padding only: it holds no state
                state = self.inner.state[view]
                if name in dtypes:
                    value = float(vec[at])
                    state[name] = torch.tensor(value, dtype=getattr(torch, dtypes[name]),
                                               device=self._scalar_device(view)) if dtypes[name] else value
                else:  # a checkpoint is read on the host: the state goes where its parameter lives
                    state[name] = vec[a:b].to(device=view.device, dtype=self.master.dtype).view_as(view).clone()
            del vec
            self._offload_state()  # offloaded: into the store before the next vector is read
        self.steps_taken = int(scalars.get("steps_taken", 0))
        self._offload_state()
        self.release_pages()
