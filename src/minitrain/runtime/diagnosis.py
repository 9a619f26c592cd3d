"""The words of a hang diagnosis and of a fingerprint mismatch (runtime/watch.py gathers the facts).

A fingerprint is (group, sequence number, op, shapes, dtype, call site); in the store it travels as JSON.
"""
from __future__ import annotations

import collections
import json
import os
import re
import sysconfig
from typing import NamedTuple

import torch


class Diagnosis(NamedTuple):
    text: str  # who is where, culprits first
    culprits: list  # global ranks named as the cause (not at the waiting ranks' position)
    step: int | None  # the training step the waiting ranks are in, when a trainer said

    def headline(self) -> str:
        return f"step {self.step}: {self.text}" if self.step is not None else self.text


def fp_json(fp: tuple) -> list:
    group, seq, op, shapes, dtype, site = fp
    return [group, seq, op, [list(s) for s in shapes], dtype, site]


def fp_text(fp: list, shapes: bool = False) -> str:
    """'all_gather #812 on dp (sharded_units.py:154)'; with `shapes`, also what it moves."""
    group, seq, op, dims, dtype, site = fp
    if group == "store":  # the periodic check, which waits for the others through the store
        return f"the {op} ({site})"
    what = f" of {', '.join('x'.join(map(str, d)) or 'scalar' for d in dims)} {dtype}" if shapes and dims else ""
    return f"{op} #{seq} on {group}{what} ({site})"


def first_sentence(e: BaseException) -> str:
    """A backend error's gist: gloo's start with the C++ source line and end with advice."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[^\]]*\] ", "", text).split(". ")[0]


def site_of(frame) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


# --- the user's line: where a rank's own script stands, for messages a user acts on ------------------------------
_FRAMEWORK = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_MODULE_CALLS = frozenset({"_wrapped_call_impl", "_call_impl"})  # nn.Module.__call__
# What a user's line called, by the callee's (file ending, function name), in the words a user wrote it.
_CALLS = {("_tensor.py", "backward"): "backward", ("autograd/__init__.py", "backward"): "backward",
          ("modules/module.py", "_wrapped_call_impl"): "the model's forward",
          ("modules/module.py", "state_dict"): "model.state_dict()",
          ("modules/module.py", "load_state_dict"): "model.load_state_dict()"}


def user_call(frame) -> tuple[str | None, str] | None:
    """(what the user's code called, 'train.py:283'), from a thread's innermost frame: the line of the user's own
    code (not torch's, minitrain's or the standard library's) nearest to the innermost frame, skipping the model's
    code when it runs inside a module's forward (the line that called the model, not a block's). What it called is
    None when that line is the innermost (in Python, or in a C function such as time.sleep); the whole is None when
    no frame is the user's (minitrain's own trainer)."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    outermost_call = max((i for i, f in enumerate(stack) if _in_framework(f) and f.f_code.co_name in _MODULE_CALLS),
                         default=-1)
    for i, f in enumerate(stack):
        if i > outermost_call and not _in_framework(f) and not f.f_code.co_filename.startswith(_STDLIB):
            return _describe(stack[:i]), site_of(f)
    return None


def _in_framework(frame) -> bool:
    return frame.f_code.co_filename.startswith(_FRAMEWORK)


def _describe(inner: list) -> str | None:
    """What a call into torch or minitrain was, as the user wrote it ('backward', 'optimizer.state_dict()'), from
    the frames it runs (innermost first); a decorator's wrapper (torch.distributed's) is looked through."""
    if not inner:
        return None
    callee = inner[-1]
    if callee.f_code.co_name == "wrapper" and len(inner) > 1:
        callee = inner[-2]
    path, name = callee.f_code.co_filename.replace(os.sep, "/"), callee.f_code.co_name
    for (ending, function), words in _CALLS.items():
        if name == function and path.endswith(ending):
            return words
    qualname = getattr(callee.f_code, "co_qualname", name)
    if qualname.startswith("PreparedOptimizer."):
        return f"optimizer.{name}()"
    if "/minitrain/api/" in path:
        return f"minitrain.{name}()"
    if "/torch/distributed/" in path:
        return f"torch.distributed.{name}()"
    return f"{qualname}()"


def ranks_text(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-2', 'ranks 0, 2, 5-7'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs, start = [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            a, b = ranks[start], ranks[i - 1]
            runs.append(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}")
            start = i
    return "ranks " + ", ".join(runs)


def _position(state: dict | None) -> tuple:
    """What ranks must share to be at the same place."""
    if state is None:
        return ("silent",)
    if state.get("closed"):
        return ("closed", json.dumps(state["last"]))
    if "at" in state:
        group, seq, op, dims, dtype, site = state["at"]
        return ("at", seq, group, op, site, json.dumps(dims), dtype)
    return ("python", state["where"], json.dumps(state["last"]))


def compose(reason: str, states: dict[int, dict | None]) -> Diagnosis:
    """One diagnosis from every rank's state (None: it did not answer), after `reason` ("collective hang (...)").
    The most ranks at one collective are
    the ones waiting; on a tie the position furthest on waits (the lower sequence number is behind); every
    other rank is a culprit."""
    where: dict[tuple, list[int]] = collections.defaultdict(list)
    for rank, state in sorted(states.items()):
        where[_position(state)].append(rank)
    collectives = [p for p in where if p[0] == "at"]
    waiting = max(collectives, key=lambda p: (len(where[p]), p[1], -where[p][0]), default=None)
    parts = []
    for position, ranks in sorted(where.items(), key=lambda item: item[1][0]):
        if position == waiting:
            continue
        state = states[ranks[0]]
        who, plural = ranks_text(ranks), len(ranks) > 1
        if position[0] == "silent":
            parts.append(f"{who} did not answer (dead or stuck outside Python)")
        elif position[0] == "closed":
            after = f" after {fp_text(state['last'])}" if state["last"] else ""
            parts.append(f"{who} {'have' if plural else 'has'} finished (closed the process group){after}")
        elif position[0] == "python":
            last = f"last finished {fp_text(state['last'])}" if state["last"] else "no collective finished yet"
            parts.append(f"{who} {'are' if plural else 'is'} not in a collective: in Python at {state['where']}"
                         f"{_from_user(state)}, {last}")
        else:  # at another collective: show what it moves when only that differs from the waiting one's
            same_call = waiting is not None and position[1:5] == waiting[1:5]
            parts.append(f"{who} {'are' if plural else 'is'} at {fp_text(state['at'], shapes=same_call)}"
                         f"{_from_user(state)}")
    culprits = sorted(r for p, ranks in where.items() if p != waiting for r in ranks)
    text = "; ".join(parts)
    step = None
    if waiting is not None:
        ranks, state = where[waiting], states[where[waiting][0]]
        shapes = any(p[0] == "at" and p != waiting and p[1:5] == waiting[1:5] for p in where)
        text += f"{' while ' if parts else ''}{ranks_text(ranks)} wait{'' if len(ranks) > 1 else 's'} in " \
                f"{fp_text(state['at'], shapes=shapes)}{_from_user(state)}"
        step = state.get("step")
    return Diagnosis(f"{reason}: {text}", culprits, step)


def _from_user(state: dict) -> str:
    """' (from backward at train.py:305)': the user's line behind a rank's position, when it has one other than the
    line the position names already."""
    user = state.get("user")
    named = state["at"][5] if "at" in state else state.get("where")
    return f" (from {user[0]} at {user[1]})" if user and user[0] and user[1] != named else ""


def first_difference(rings: dict[int, list], counts: dict[int, int], kept: int) -> str:
    """The first collective (by its number among the group's symmetric ones) at which the members' recent
    fingerprints differ; `rings`: per rank, [[number, fingerprint], ...]; `counts`: how many each issued."""
    by_rank = {r: {n: fp for n, fp in ring} for r, ring in rings.items()}
    common = set.intersection(*(set(numbers) for numbers in by_rank.values()))
    for n in sorted(common):
        calls = collections.defaultdict(list)
        for rank, fps in sorted(by_rank.items()):
            _group, _seq, op, dims, dtype, site = fps[n]
            calls[json.dumps([op, dims, dtype, site])].append(rank)
        if len(calls) > 1:
            sides = sorted(calls.values(), key=lambda ranks: (-len(ranks), ranks[0]))
            return "first difference: " + ", ".join(
                f"{ranks_text(ranks)} at {fp_text(by_rank[ranks[0]][n], shapes=True)}" for ranks in sides)
    issued = collections.defaultdict(list)
    for rank, count in counts.items():
        issued[count].append(rank)
    tally = ", ".join(f"{ranks_text(r)} issued {c}" for c, r in sorted(issued.items()))
    if not common:
        return f"{tally}; the first difference is older than the last {kept} collectives each rank keeps"
    return f"{tally}; the last {kept} collectives each rank keeps agree where they overlap"
