"""Hangs that name the culprit, and a cheap check that every rank still issues the same collectives.

Every collective through comm.py carries a fingerprint, a plain tuple

    (group, sequence number in that group, op, shapes, dtype, call site)

the call site being the first frame outside comm.py ("sharded_units.py:154"). One CollectiveWatch per process, made
by Topology when it joins a process group, hears from comm.py when this rank enters and leaves a collective,
and keeps per group a running digest of the fingerprints and, per process, the last RING of them.

A daemon thread polls the rendezvous store, a side channel that still works while every collective is stuck
(its own clone of the store, so it never waits behind the main thread's store calls):
- a rank inside one collective longer than the timeout declares a hang there;
- once a hang is declared, every rank publishes where it is: in which collective and for how long, or where
  in Python its main thread is and which collective it finished last;
- every rank collects all ranks' states (waiting at most ANSWER_WAIT_S; a rank that never answers is named
  so) and composes the diagnosis (diagnosis.py); the first one stored is the one every rank uses;
- it reports that diagnosis (to the launcher, or on stderr) and ends the process, unless the main thread asked
  for it (one of its collectives raised), which then raises it in a CollectiveError.
The process-group timeout is the watch's plus MARGIN_S, so the diagnosis always comes before gloo gives up.

Ranks can also diverge without hanging: two reaching the same op and shape from different lines. Every
`dist.fingerprint_every` steps the trainer has the ranks compare, through the store (no collective), each
group's count and digest of its collectives so far (`compare`); a mismatch names the ranks and the first
fingerprint that differs.
"""
from __future__ import annotations

import collections
import contextlib
import json
import operator
import os
import sys
import threading
import time
import zlib
from datetime import timedelta

from .comm import CollectiveError, call_site
from .diagnosis import (
    Diagnosis,
    compose,
    first_difference,
    first_sentence,
    fp_json,
    ranks_text,
    site_of,
    user_call,
)

POLL_S = 0.5  # how often the thread looks at the store: one round trip each time
ANSWER_WAIT_S = 2.0  # how long a diagnosis waits for every rank's state before naming the silent ones
DIAGNOSE_WAIT_S = ANSWER_WAIT_S + 2 * POLL_S + 1.0  # the main thread's bound on waiting for one
MARGIN_S = 10.0  # the process group's timeout exceeds the watch's by this much
RING = 256  # recent fingerprints kept per process, to name the first one that differs
P2P_OPS = frozenset({"send", "recv", "send/recv"})  # one-sided by nature: never compared between ranks
# The signal counter, one number read in one round trip per poll: hang declarations add 1, requests that every rank
# say where it is (arrival.py) add PROBE, and rank 0 adds CLOSING as it closes.
PROBE = 1 << 20
CLOSING = 1 << 44
STORE_OP_S = 5.0  # the watch thread's bound on any one store call (its store is a clone of its own)


class GroupTrack:
    """One process group's collectives on this rank. `seq` numbers every op for diagnoses; `checked` and
    `digest` cover the symmetric ones (every member issues the same), which the periodic check compares.
    Ops are issued by the thread that runs the step (or, on CUDA, autograd's thread while the step's thread
    waits in backward), never two at once, so no lock."""

    __slots__ = ("arrivals", "checked", "digest", "key", "members", "name", "ring", "seq")

    def __init__(self, name: str, members: list[int], ring: collections.deque):
        # The group's lowest global rank tells apart the groups of one kind (the dp group of each tp rank).
        self.name, self.key, self.members, self.ring = name, f"{name}@{min(members)}", list(members), ring
        self.seq = self.checked = self.digest = 0
        self.arrivals = 0  # calls every member makes together, announced in the store (arrival.py)

    def issue(self, op: str, tensors: tuple, site: str) -> tuple:
        """The next fingerprint: the larger part of what the watch costs a collective (docs/fault-tolerance.md),
        mostly reading .shape and building tuples."""
        self.seq += 1
        shapes = tuple(map(_SHAPE, tensors))
        dtype = _dtype_name(tensors[0].dtype) if tensors else ""
        fp = (self.name, self.seq, op, shapes, dtype, site)
        if op not in P2P_OPS:
            self.checked += 1
            # hash() of ints and tuples of ints is the same in every process (str hashes are salted per
            # process, hence the crc32 of each string, cached).
            self.digest = hash((self.digest, _crc(op), shapes, _crc(dtype), _crc(site)))
            self.ring.append((self.key, self.checked, fp))
        return fp


class CollectiveWatch:
    """This process's watch: see the module docstring.

    Cost per collective (fingerprint, call site, digest, ring, enter/leave): small next to the smallest gloo
    all-reduce (the figures and how they were taken: docs/fault-tolerance.md). The thread costs one store round
    trip per POLL_S per rank."""

    def __init__(self, rank: int, world_size: int, store, timeout_s: float, report=None):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._report = report or _print_report
        self._store = store  # the main thread's: the periodic check
        self._side = store.clone() if hasattr(store, "clone") else store  # the watch thread's
        if hasattr(self._side, "set_timeout"):
            self._side.set_timeout(timedelta(seconds=STORE_OP_S))
        # Keys of this process group's session: a store can outlive a process group (a launcher's, or a
        # multi-tenant TCPStore in one process), and its old keys must not be read as new ones.
        session = (store.add("minitrain/watch/joined", 1) - 1) // world_size
        self._prefix = f"minitrain/watch/{session}/"
        self._tracks: dict[str, GroupTrack] = {}
        self._groups: dict[str, GroupTrack] = {}  # this rank's group of each kind, by name
        self._answered = 0  # the last request to say where this rank is (PROBE) that the thread answered
        self.arriving: dict | None = None  # the arrival the main thread waits at (arrival.py): its group and number
        self._ring: collections.deque = collections.deque(maxlen=RING)
        self._current: tuple | None = None  # (fingerprint, monotonic time entered) of the collective we are in
        # Collectives the host has left but the device may not have finished (GPU): (fingerprint, entered, done).
        self._outstanding: collections.deque = collections.deque()
        self._last: tuple | None = None  # the last one this rank finished
        self._step: int | None = None  # the training step in progress, when a trainer says
        self._checks = 0  # periodic checks so far: their keys' names (a rolled-back run repeats its steps)
        self._previous_check: str | None = None
        self._lock = threading.Lock()
        self._request: str | None = None  # why the main thread asked for a diagnosis
        self._main_asked = False
        self._diagnosis: Diagnosis | None = None
        self._ready, self._wake, self._stop = threading.Event(), threading.Event(), threading.Event()
        self._main_ident = threading.get_ident()  # the thread that runs the collectives
        self._thread = threading.Thread(target=self._loop, name="minitrain-collective-watch", daemon=True)
        self._thread.start()

    # --- what comm.py tells it ---------------------------------------------------------------
    def track(self, name: str, members: list[int]) -> GroupTrack:
        """The sequence of the group `name` with these global ranks (one per group, however many Comms)."""
        key = f"{name}@{min(members)}"
        track = self._tracks.setdefault(key, GroupTrack(name, members, self._ring))
        self._groups[name] = track  # a rank is in one group of each kind: its collectives in `name` are there
        return track

    def enter(self, fp: tuple) -> None:
        self._current = (fp, time.monotonic())

    def leave(self, fp: tuple) -> None:
        self._current = None
        self._last = fp

    def outstanding(self, fp: tuple, done) -> None:
        """On a GPU the host leaves a collective as soon as it is queued: the device is in it until `done()` says
        otherwise. The thread watches such collectives like the one the host is in (a hang in one is a hang)."""
        with self._lock:
            while self._outstanding and self._outstanding[0][2]():  # finished ones go as new ones come
                self._outstanding.popleft()
            self._outstanding.append((fp, time.monotonic(), done))

    def diagnose(self, reason: str, fp: tuple | None) -> Diagnosis | None:
        """Called when collective `fp` raised in the main thread: the diagnosis every rank agrees on, waiting at
        most DIAGNOSE_WAIT_S for it (None if it did not come). The caller raises it; the watch then neither
        reports it nor ends the process."""
        if fp is not None and (self._current is None or self._current[0] is not fp):
            self._current = (fp, time.monotonic())  # it failed to start: this rank is still where it failed
        with self._lock:
            self._main_asked = True
            if self._request is None:
                self._request = reason
        self._wake.set()
        if self._thread.is_alive():
            self._ready.wait(DIAGNOSE_WAIT_S)
        return self._diagnosis

    @property
    def store(self):
        """The main thread's store (the thread has a clone of its own)."""
        return self._store

    @property
    def prefix(self) -> str:
        """This process group's session in the store: every key of the watch's starts with it."""
        return self._prefix

    @property
    def step(self) -> int | None:
        return self._step

    # --- what the trainer tells it -------------------------------------------------------------
    def at_step(self, step: int, every: int) -> None:
        """Step `step` starts: hang diagnoses name it, and after every `every` steps (0 = never) the ranks
        compare their collectives so far."""
        self._step = step
        done = step - 1
        if every > 0 and done > 0 and done % every == 0:
            self.compare(f"after step {done}")

    def compare(self, label: str) -> None:
        """Collective in effect, through the store only: every rank publishes, per group, how many symmetric
        collectives it issued and their running digest, under a key for this check, and reads the others'.
        Three store round trips, one value of a few dozen bytes per group. A mismatch raises CollectiveError
        naming the ranks that differ and the first fingerprint that differs (from the ring)."""
        self._checks += 1
        base = f"{self._prefix}check/{self._checks}/"
        keys = [f"{base}{r}" for r in range(self.world_size)]
        mine = {key: [t.checked, t.digest] for key, t in self._tracks.items()}
        # While it waits for the others it counts as in a collective: a rank that never comes is diagnosed.
        self._current = (("store", 0, f"fingerprint check {label}", (), "", call_site(__file__)), time.monotonic())
        try:
            self._store.set(keys[self.rank], json.dumps(mine))
            self._store.wait(keys, timedelta(seconds=self.timeout_s + MARGIN_S))
            values = [json.loads(v) for v in self._store.multi_get(keys)]
        finally:
            self._current = None
        groups: dict[str, dict[int, tuple]] = {}
        for rank, value in enumerate(values):
            for key, counts in value.items():
                groups.setdefault(key, {})[rank] = tuple(counts)
        bad = sorted(key for key, members in groups.items() if len(set(members.values())) > 1)
        if not bad:
            if self._previous_check is not None:  # everyone has read it: the previous check's own key goes
                self._store.delete_key(self._previous_check)
            self._previous_check = keys[self.rank]
            return
        message, differ = self._explain(base, bad[0], groups[bad[0]], label)
        raise CollectiveError(message, culprit=self.rank in differ)

    def _explain(self, base: str, key: str, members: dict[int, tuple], label: str) -> tuple[str, list[int]]:
        """The mismatch in group `key`, with the first fingerprint that differs: each member publishes its ring
        of that group, and every rank reads them all (the same text on every rank)."""
        counts = collections.Counter(members.values())
        usual = max(counts, key=lambda c: (counts[c], -min(r for r, v in members.items() if v == c)))
        differ = sorted(r for r, v in members.items() if v != usual)
        same = sorted(r for r, v in members.items() if v == usual)
        group = key.split("@")[0]
        head = (f"fingerprint check {label}: in group {group} ({ranks_text(sorted(members))}), "
                f"{ranks_text(differ)} issued other collectives than {ranks_text(same)}")
        ring_keys = {r: f"{base}ring/{r}" for r in members}
        if self.rank in members:
            self._store.set(ring_keys[self.rank], json.dumps([[n, fp_json(fp)] for k, n, fp in self._ring if k == key]))
        try:
            self._store.wait(list(ring_keys.values()), timedelta(seconds=ANSWER_WAIT_S))
            rings = {r: json.loads(v) for r, v in zip(ring_keys, self._store.multi_get(list(ring_keys.values())))}
        except RuntimeError:  # a member did not publish in time (it failed otherwise): the digests must do
            return f"{head}; the first difference is unknown (not every rank published its recent collectives)", differ
        with contextlib.suppress(RuntimeError):  # every rank raises next: none may take the store away before
            self._all_have_read(self._store, base, self.world_size)
        return f"{head}: {first_difference(rings, {r: v[0] for r, v in members.items()}, RING)}", differ

    # --- the thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        hang_key, signal = self._prefix + "hang", self._prefix + "signal"
        alone = None  # why the store can no longer be asked, once it cannot
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            reason = self._due()
            declared = reason is not None
            if alone is None:
                try:
                    if declared:
                        self._side.compare_set(hang_key, "", reason)  # the first declaration stays
                        self._side.add(signal, 1)
                    flags = self._side.add(signal, 0)  # one round trip: hangs declared, probes, rank 0 closing
                    declared = declared or flags % PROBE > 0
                    probes = flags % CLOSING // PROBE
                    if probes > self._answered and not declared:  # ranks waiting at an arrival ask where we are
                        # One key per rank, overwritten: the answer says which request it answers (every one so far).
                        self._side.set(f"{self._prefix}where/{self.rank}", json.dumps({**self._state(), "probe": probes}))
                        self._answered = probes
                    if declared:
                        self._deliver(self._settle(self._side.get(hang_key).decode()))
                        return
                    if flags >= CLOSING:  # stop asking before its host goes (each failed try prints a warning)
                        self._side.set(f"{self._prefix}ack/{self.rank}", "1")
                        alone = "rank 0 has closed the process group, and the store with it"
                except Exception as e:  # noqa: BLE001 - the store is unreachable (its host rank is gone)
                    alone = f"the rendezvous store is unreachable: {first_sentence(e)}"
            if declared and alone is not None:  # this rank is stuck, was asked, or heard of a hang: say it alone
                self._deliver(Diagnosis(f"{reason or 'collective hang'}: the other ranks could not be asked ({alone}); "
                                        f"rank {self.rank}: {json.dumps(self._state())}", [], self._step))
                return

    def _in_collective(self) -> tuple | None:
        """(fingerprint, entered) of the collective this rank is in: the one the host waits in, else the oldest the
        device has not finished (those finished are dropped, oldest first)."""
        if self._current is not None:
            return self._current
        with self._lock:
            while self._outstanding and self._outstanding[0][2]():
                self._outstanding.popleft()
            return self._outstanding[0][:2] if self._outstanding else None

    def _due(self) -> str | None:
        """Why this rank should declare a hang now, if it should."""
        with self._lock:
            if self._request is not None:
                return self._request
        current = self._in_collective()
        if current is not None:
            waited = time.monotonic() - current[1]
            if waited > self.timeout_s:
                return f"collective hang (rank {self.rank} stuck {waited:.1f} s in a collective, timeout {self.timeout_s:g} s)"
        return None

    def _settle(self, reason: str) -> Diagnosis:
        """Publish this rank's state, collect everyone's, and return the diagnosis stored first."""
        state_keys = [f"{self._prefix}state/{r}" for r in range(self.world_size)]
        self._side.set(state_keys[self.rank], json.dumps(self._state()))
        deadline = time.monotonic() + ANSWER_WAIT_S
        while not self._side.check(state_keys) and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.05)
        present = [k for k in state_keys if self._side.check([k])]
        got = dict(zip(present, self._side.multi_get(present))) if present else {}
        states = {r: json.loads(got[k]) if k in got else None for r, k in enumerate(state_keys)}
        mine = compose(reason, states)
        stored = self._side.compare_set(self._prefix + "diagnosis", "", json.dumps(mine._asdict()))
        # Report only once every rank that answered has the diagnosis too: the store's host (rank 0) must not
        # exit before, and the culprit's report then reaches a launcher together with the others'.
        live = sum(1 for state in states.values() if state is not None and not state.get("closed"))
        self._all_have_read(self._side, self._prefix, int(self._side.compare_set(self._prefix + "live", "", str(live))))
        return Diagnosis(**json.loads(stored))

    def _all_have_read(self, store, prefix: str, ranks: int) -> None:
        """Wait (at most ANSWER_WAIT_S) until `ranks` ranks have read what they need from the store: its host,
        rank 0 (but under torchrun's agent), must not exit before, and every rank then reports at once."""
        if store.add(prefix + "read", 1) >= ranks:
            store.set(prefix + "all-read", "1")
        else:
            with contextlib.suppress(RuntimeError):  # one died meanwhile: go on all the same
                store.wait([prefix + "all-read"], timedelta(seconds=ANSWER_WAIT_S))
        if self.rank == 0:  # the host's answers to the others' waits must go out before it exits
            time.sleep(0.2)

    def _state(self) -> dict:
        """Where this rank is: in a collective (with its group's members), or in Python (the main thread's innermost
        frame); and the user's line it is at (diagnosis.user_call), and the arrival it waits at, if any."""
        current, state = self._in_collective(), {"rank": self.rank, "step": self._step}
        frame = sys._current_frames().get(self._main_ident)
        if current is not None:
            state.update(at=fp_json(current[0]), for_s=round(time.monotonic() - current[1], 1))
            group = self._groups.get(current[0][0])
            if group is not None:
                state["members"] = group.members
            # Its number among its group's symmetric collectives (point to point ones have none): what every member
            # counts alike. (The ring is appended to by the main thread; a copy of a deque is taken at once.)
            state["symmetric"] = next((n for _, n, fp in reversed(tuple(self._ring)) if fp is current[0]), None)
        else:
            state.update(where=site_of(frame) if frame is not None else "(its thread has ended)",
                         last=fp_json(self._last) if self._last else None)
        user = user_call(frame) if frame is not None else None
        if user is not None:
            state["user"] = list(user)
        if self.arriving is not None:
            state["arriving"] = self.arriving
        return state

    # --- what arrival.py asks of it (the main thread, waiting at an arrival) -----------------------------------
    def issued(self) -> dict[str, int]:
        """How many symmetric collectives (every member issues them) this rank has issued in each of its groups."""
        return {name: track.checked for name, track in self._groups.items()}

    def stop_everyone(self, diagnosis: Diagnosis) -> Diagnosis:
        """End every rank with `diagnosis` (unless another was declared first: that one), as a hang does: the other
        ranks' threads report it and end their processes; the caller raises the one returned."""
        stored = self._store.compare_set(self._prefix + "diagnosis", "", json.dumps(diagnosis._asdict()))
        agreed = Diagnosis(**json.loads(stored))  # the first one declared, every rank's
        if self._report is _print_report:  # said at once: under torchrun the first rank to exit gets the others
            _print_report(agreed.headline(), self.rank in agreed.culprits)  # killed, before their exceptions print
        self.diagnose(agreed.text, None)  # the other ranks' threads report it and end their processes
        return agreed

    def _deliver(self, diagnosis: Diagnosis) -> None:
        with self._lock:
            self._diagnosis = diagnosis
            asked = self._main_asked
        self._ready.set()
        if asked or self._stop.is_set():
            return  # the main thread raises it (or it is closing the process group: nothing left to end)
        frame = sys._current_frames().get(self._main_ident)
        stack = "".join(_format_stack(frame)) if frame is not None else "(ended)\n"
        self._report(f"{diagnosis.headline()}\n\nrank {self.rank}'s main thread at that moment:\n{stack}",
                     self.rank in diagnosis.culprits)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the main thread may be blocked in a collective that will never return

    def close(self) -> None:
        """Stop the thread (before the process group goes), and leave a note for any later diagnosis."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=ANSWER_WAIT_S + 2 * STORE_OP_S)
        state = {"rank": self.rank, "step": self._step, "closed": True,
                 "last": fp_json(self._last) if self._last else None}
        keys = [f"{self._prefix}state/{r}" for r in range(self.world_size)]
        with contextlib.suppress(RuntimeError):  # the store's host may be gone already; the note is a courtesy
            self._store.set(keys[self.rank], json.dumps(state))
            if self.rank == 0:  # the store's host (but under torchrun's agent): the others stop asking it first
                self._store.add(self._prefix + "signal", CLOSING)
                self._until_let_go(keys)

    def _until_let_go(self, states: list[str]) -> None:
        """Rank 0, closing: wait (at most ANSWER_WAIT_S) until every other rank has closed too or its watch has
        seen that rank 0 closes (within a poll)."""
        acks = [f"{self._prefix}ack/{r}" for r in range(self.world_size)]
        pending, deadline = set(range(1, self.world_size)), time.monotonic() + ANSWER_WAIT_S
        while pending and time.monotonic() < deadline:
            if self._store.check(states[1:]):
                return
            pending = {r for r in pending if not (self._store.check([states[r]]) or self._store.check([acks[r]]))}
            if pending:
                time.sleep(0.05)


def _print_report(text: str, culprit: bool) -> None:
    """Without a launcher to tell (torchrun, or a process group of one's own): stderr, then exit 1."""
    print(text, file=sys.stderr, flush=True)


def _format_stack(frame) -> list[str]:
    import traceback

    return traceback.format_stack(frame, limit=12)  # the innermost frames: what a traceback would end with


_SHAPE = operator.attrgetter("shape")
_CRCS: dict[str, int] = {}
_DTYPES: dict = {}


def _crc(text: str) -> int:
    value = _CRCS.get(text)
    if value is None:
        value = _CRCS[text] = zlib.crc32(text.encode())
    return value


def _dtype_name(dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = str(dtype).rsplit(".", 1)[-1]
    return name
