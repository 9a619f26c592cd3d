"""Pipeline schedules as data: for each stage, the ordered list of what it does.

A schedule is a plain function (stages P, micro-batches M) -> one list of Actions per stage.
One executor (executor.py) runs any of them; `simulate` plays them on an ideal clock, which
gives the text timeline of `minitrain pp-schedule`, the bubble each schedule should have and a
deadlock check that needs no processes.

- GPipe (Huang et al. 2019): every forward, then every backward. Each stage holds the
  activations of all M micro-batches at once.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's default): stage s runs
  min(P - s - 1, M) warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards. A micro-batch's activations are freed by its backward as
  soon as possible, so stage s never holds more than min(P - s, M): at most P, not M.

Both leave every stage idle for the same share of the step, the bubble (P - 1) / (M + P - 1),
whatever the ratio of backward to forward time: 1F1B saves memory, not time.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward or "B" backward
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards in the same order, on every stage."""
    _check(stages, microbatches)
    one = [Action("F", m) for m in range(microbatches)] + [Action("B", m) for m in range(microbatches)]
    return [list(one) for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """Warm-up forwards, then one forward / one backward in turn, then the remaining backwards."""
    _check(stages, microbatches)
    schedule = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        actions = [Action("F", m) for m in range(warmup)]
        for m in range(warmup, microbatches):  # steady state: the forward of m, the oldest backward
            actions += [Action("F", m), Action("B", m - warmup)]
        actions += [Action("B", m) for m in range(microbatches - warmup, microbatches)]
        schedule.append(actions)
    return schedule


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _check(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a pipeline needs at least 1 stage and 1 micro-batch (got {stages} and {microbatches})")


def expected_bubble(stages: int, microbatches: int) -> float:
    """Share of a step each stage idles in GPipe and 1F1B: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward has run and whose backward has not, at any point of a stage's list:
    the activations the stage must hold at once."""
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class Slot:
    stage: int
    action: Action
    start: int
    stop: int


class DeadlockError(RuntimeError):
    """A schedule in which some stage waits forever."""


def simulate(schedule: list[list[Action]], forward_cost: int = 1, backward_cost: int = 1) -> list[Slot]:
    """Play a schedule on an ideal clock: each stage runs its actions in order, each as soon as its
    input exists: F(s, m) after F(s - 1, m); B(s, m) after B(s + 1, m) (the last stage: after its own
    F(s, m)). Communication is free. Raises DeadlockError if the stages wait on each other in a circle."""
    stages = len(schedule)
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> finish time
    position, clock, slots = [0] * stages, [0] * stages, []
    while any(position[s] < len(schedule[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(schedule[s]):
                continue
            a = schedule[s][position[s]]
            if a.kind == "F":
                needs = ("F", s - 1, a.microbatch) if s > 0 else None
            else:
                needs = ("B", s + 1, a.microbatch) if s < stages - 1 else ("F", s, a.microbatch)
            if needs is not None and needs not in done:
                continue
            start = max(clock[s], done[needs] if needs else 0)
            stop = start + (forward_cost if a.kind == "F" else backward_cost)
            done[(a.kind, s, a.microbatch)] = clock[s] = stop
            slots.append(Slot(s, a, start, stop))
            position[s] += 1
            progressed = True
        if not progressed:
            waiting = ", ".join(f"stage {s} at {schedule[s][position[s]]}" for s in range(stages)
                                if position[s] < len(schedule[s]))
            raise DeadlockError(f"schedule deadlocks: {waiting} wait on each other")
    return slots


def simulated_bubble(slots: list[Slot], stages: int) -> list[float]:
    """Per stage, the share of the whole run (first start to last stop) it spends idle."""
    span = max(s.stop for s in slots) - min(s.start for s in slots)
    busy = [0] * stages
    for slot in slots:
        busy[slot.stage] += slot.stop - slot.start
    return [1 - b / span for b in busy]


def render_timeline(name: str, schedule: list[list[Action]], forward_cost: int = 1, backward_cost: int = 1) -> str:
    """The schedule as text: one row per stage, one column per clock tick, '.' where the stage idles;
    then each stage's bubble and peak in-flight micro-batches against the formulas."""
    stages, microbatches = len(schedule), sum(a.kind == "F" for a in schedule[0])
    slots = simulate(schedule, forward_cost, backward_cost)
    span = max(s.stop for s in slots)
    width = len(str(microbatches - 1)) + 2  # a kind letter, the micro-batch number, a space
    grid = [[".".ljust(width)] * span for _ in range(stages)]
    for slot in slots:
        for t in range(slot.start, slot.stop):
            grid[slot.stage][t] = str(slot.action).ljust(width)
    bubbles = simulated_bubble(slots, stages)
    title = (f"{name}: {stages} stages, {microbatches} micro-batches; a forward takes {forward_cost} tick"
             f"{'s' if forward_cost > 1 else ''}, a backward {backward_cost} (Fn / Bn: micro-batch n, . idle)")
    lines = [title, ""]
    lines += [f"stage {s} | " + "".join(row).rstrip() for s, row in enumerate(grid)]
    lines += ["", f"{'stage':>5}  {'bubble':>6}  {'in flight (peak)':>16}"]
    for s in range(stages):
        lines.append(f"{s:>5}  {bubbles[s]:>6.1%}  {peak_in_flight(schedule[s]):>16}")
    lines.append(f"bubble (P-1)/(M+P-1) = {expected_bubble(stages, microbatches):.1%}; peak in flight: "
                 f"1f1b min(P-s, M) <= P = {stages}, gpipe M = {microbatches}")
    return "\n".join(lines)
