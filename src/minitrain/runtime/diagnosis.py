"""The words of a hang diagnosis and of a fingerprint mismatch (runtime/watch.py gathers the facts).

A fingerprint is (group, sequence number, op, shapes, dtype, call site); in the store it travels as JSON.
"""
from __future__ import annotations

import collections
import json
import os
import re
from typing import NamedTuple


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
    """'all_gather #812 on dp (zero3.py:80)'; with `shapes`, also what it moves."""
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
            parts.append(f"{who} {'are' if plural else 'is'} not in a collective: in Python at {state['where']}, "
                         f"{last}")
        else:  # at another collective: show what it moves when only that differs from the waiting one's
            same_call = waiting is not None and position[1:5] == waiting[1:5]
            parts.append(f"{who} {'are' if plural else 'is'} at {fp_text(state['at'], shapes=same_call)}")
    culprits = sorted(r for p, ranks in where.items() if p != waiting for r in ranks)
    text = "; ".join(parts)
    step = None
    if waiting is not None:
        ranks, state = where[waiting], states[where[waiting][0]]
        shapes = any(p[0] == "at" and p != waiting and p[1:5] == waiting[1:5] for p in where)
        text += f"{' while ' if parts else ''}{ranks_text(ranks)} wait{'' if len(ranks) > 1 else 's'} in " \
                f"{fp_text(state['at'], shapes=shapes)}"
        step = state.get("step")
    return Diagnosis(f"{reason}: {text}", culprits, step)


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
