"""Calls every rank must make together, checked through the store before any rank moves data.

A collective that one rank reaches alone (a save or an evaluation under `if rank == 0:`, as DDP scripts write
them) pairs with whatever collective the other ranks issue next: gloo fails with a size mismatch, both wait for
ever, or two gathers of one size pair up and compute with each other's data. So each call of the user's that is
collective only because of how minitrain holds the model (optimizer.state_dict() over shards, full_state_dict,
save and load, a ZeRO-3 forward without gradients) first announces itself in the rendezvous store, with the user's
line (diagnosis.user_call), and waits until every member of its group has announced it too:

- every member announces the same call: it goes on (a store write, a few checks, a read);
- one announces another call: every rank raises, naming each rank's call and line;
- one does not come: after GRACE_S the waiting ranks ask where it is (where_are, answered by its
  watch thread within a poll). If it can never come (it waits in a collective that needs a rank waiting here, at
  another arrival, in a torch.distributed call of its own, or has finished), every rank is stopped at once with
  one message naming each rank's call and line (CollectiveWatch.stop_everyone). If it is in Python (slower, not
  lost) the wait goes on, asking again every REASK_S, until `timeout_s`.

A hot-path collective (a backward's gradient sync, the step) announces nothing: this costs only the calls that
announce, and a rank that waits in a hot-path collective is found by being asked.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass

from .comm import CollectiveError, Comm, call_site
from .diagnosis import Diagnosis, fp_text, ranks_text, user_call
from .watch import ANSWER_WAIT_S, CLOSING, PROBE, CollectiveWatch, GroupTrack

GRACE_S = 0.5  # how long a rank waits for the others before asking where they are
REASK_S = 2.0  # how often it asks again while a rank it waits for is busy in Python
POLL_S = 0.05  # the longest pause between two looks at the store (TCPStore's wait warns on each time-out)


def arrive(comm: Comm, what: str, why: str, timeout_s: float | None = None) -> None:
    """Wait until every rank of `comm` calls `what` here; raise CollectiveError naming where each rank is otherwise
    (see the module docstring). `why`: what to do, for the message ("at ZeRO-1 the optimizer's state is sharded:
    call it on every rank"). timeout_s: how long a rank busy elsewhere is waited for (default: the watch's).
    Nothing to wait for without a watch (one rank, or no process group)."""
    watch, group = comm.watch, comm.group_track
    if watch is None or group is None:
        return
    _arrive(watch, group, what, why, watch.timeout_s if timeout_s is None else timeout_s)


def _arrive(watch: CollectiveWatch, group: GroupTrack, what: str, why: str, timeout_s: float) -> None:
    group.arrivals += 1
    here = Arrival(group.key, group.arrivals, group.members)
    base, store = f"{watch.prefix}arrive/{here.group}/{here.number}/", watch.store
    keys = {r: f"{base}{r}" for r in here.members}
    user = user_call(sys._getframe())
    mine = {"what": what, "site": user[1] if user else call_site(__file__), "issued": watch.issued()}
    store.set(keys[watch.rank], json.dumps(mine))
    if store.add(base + "count", 1) == len(here.members):  # the last to come says so: the others look at one key
        store.set(base + "all", "1")
    watch.arriving = here.as_json()
    start = time.monotonic()
    ask_at, pause = start + GRACE_S, 0.001
    try:
        while not store.check([base + "all"]):
            now = time.monotonic()
            if now - start > timeout_s:
                posts, states = _where_everyone_is(watch, keys)
                raise CollectiveError(f"{_positions(posts, states)} (waited {timeout_s:g} s): {why}",
                                      culprit=watch.rank in _odd_ones(posts, states))
            if now >= ask_at:
                _ask_the_absent(watch, here, keys, why)
                ask_at = time.monotonic() + REASK_S
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
        posts = _posts(store, keys, here.members)
    finally:
        watch.arriving = None
    if any(post["what"] != what for post in posts.values()):
        raise CollectiveError(f"{_positions(posts, {})}: {why}", culprit=watch.rank in _odd_ones(posts, {}))
    if here.number > 1:  # every member has come here, so is past the previous arrival: its keys go
        before = f"{watch.prefix}arrive/{here.group}/{here.number - 1}/"
        store.delete_key(f"{before}{watch.rank}")
        if watch.rank == min(here.members):
            store.delete_key(before + "count")
            store.delete_key(before + "all")


@dataclass(frozen=True)
class Arrival:
    """One arrival: the group's key in the watch ("world@0"), its number there, the group's global ranks."""
    group: str
    number: int
    members: list[int]

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def _posts(store, keys: dict[int, str], ranks: list[int]) -> dict[int, dict]:
    values = store.multi_get([keys[r] for r in ranks]) if ranks else []
    return {r: json.loads(v) for r, v in zip(ranks, values)}


def where_are(watch: CollectiveWatch, ranks: list[int], wait_s: float) -> dict[int, dict | None]:
    """Every rank in `ranks` says where it is (its watch thread answers within a poll, under one key per rank that
    names the request it answers; or it has left its note on closing); None for a rank that did neither within
    `wait_s`."""
    store, prefix = watch.store, watch.prefix
    probe = store.add(prefix + "signal", PROBE) % CLOSING // PROBE
    deadline, answered = time.monotonic() + wait_s, {}
    while True:
        for r in ranks:
            if r in answered:
                continue
            answer, note = f"{prefix}where/{r}", f"{prefix}state/{r}"  # the watch thread's, close()'s
            if store.check([answer]) and (value := json.loads(store.get(answer)))["probe"] >= probe:
                answered[r] = value
            elif store.check([note]) and (value := json.loads(store.get(note))).get("closed"):
                answered[r] = value
        if len(answered) == len(ranks) or time.monotonic() >= deadline:
            return {r: answered.get(r) for r in ranks}
        time.sleep(POLL_S)  # (a TCPStore wait that times out warns on stderr)


def _where_everyone_is(watch: CollectiveWatch, keys: dict[int, str]) -> tuple[dict[int, dict], dict[int, dict | None]]:
    """(what the ranks that came posted, where the others say they are)."""
    store = watch.store
    absent = [r for r, k in keys.items() if not store.check([k])]
    states = where_are(watch, absent, ANSWER_WAIT_S)
    # One that came while it was asked (and may be past here, in the next collective) is not absent.
    states = {r: state for r, state in states.items() if not store.check([keys[r]])}
    return _posts(store, keys, [r for r in keys if r not in states]), states


def _ask_the_absent(watch: CollectiveWatch, here: Arrival, keys: dict[int, str], why: str) -> None:
    """Ask the ranks that have not come where they are; if one never can, stop every rank (raises)."""
    posts, states = _where_everyone_is(watch, keys)
    if not any(_cannot_come(state, here, posts) for state in states.values()):
        return
    diagnosis = watch.stop_everyone(Diagnosis(f"{_positions(posts, states)}: {why}", _odd_ones(posts, states),
                                              watch.step))
    raise CollectiveError(diagnosis.text, culprit=watch.rank in diagnosis.culprits)


def _cannot_come(state: dict | None, here: Arrival, posts: dict[int, dict]) -> bool:
    """Whether a rank that has not come to arrival `here`, where `state` says it is, never can."""
    if state is None:  # it did not answer: slow, or stuck outside Python; the timeout tells
        return False
    if state.get("closed"):
        return True
    other = state.get("arriving")
    if other is not None:
        if other["group"] == here.group:  # still at the one before (it comes next), or at one after: never
            return other["number"] > here.number
        return any(r in other["members"] for r in posts)  # it waits there for ranks that wait here
    if "at" in state:
        # It waits in a collective, numbered among its group's symmetric ones, for ranks here that have not issued
        # it yet: they never will. (Point to point ops have no such number: one-sided, the timeout tells.)
        group, number = state["at"][0], state.get("symmetric")
        return number is not None and any(r in state.get("members", ()) and post["issued"].get(group, 0) < number
                                          for r, post in posts.items())
    call = (state.get("user") or [None])[0]
    return bool(call) and call.startswith("torch.distributed.")  # in a collective of the user's own


def _positions(posts: dict[int, dict], states: dict[int, dict | None]) -> str:
    """'rank 0 is in optimizer.state_dict() at train.py:283; rank 1 is in backward at train.py:305'."""
    where: dict[str, list[int]] = {}
    for rank in sorted({*posts, *states}):
        text = f"in {posts[rank]['what']} at {posts[rank]['site']}" if rank in posts else _where(states[rank])
        where.setdefault(text, []).append(rank)
    return "; ".join(f"{ranks_text(ranks)} {'are' if len(ranks) > 1 else 'is'} {text}" for text, ranks in
                     sorted(where.items(), key=lambda item: item[1][0]))


def _where(state: dict | None) -> str:
    if state is None:
        return "not answering (dead, or stuck outside Python)"
    if state.get("closed"):
        return "finished (it has closed the process group)"
    call, site = state.get("user") or (None, None)
    if site is not None:
        return f"in {call} at {site}" if call else f"in Python at {site}"
    if "at" in state:
        return f"at {fp_text(state['at'])}"
    return f"in Python at {state['where']}"


def _odd_ones(posts: dict[int, dict], states: dict[int, dict | None]) -> list[int]:
    """The ranks named as the cause: the fewer side (those here, on a tie)."""
    calls: dict[str, list[int]] = {}
    for rank, post in posts.items():
        calls.setdefault(post["what"], []).append(rank)
    sides = [*calls.values(), sorted(states)] if states else list(calls.values())
    sides = [side for side in sides if side]
    if len(sides) < 2:
        return []
    most = max(sides, key=lambda side: (len(side), side is sides[-1] and bool(states)))
    return sorted(r for side in sides if side is not most for r in side)
