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

- Zero-bubble, ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): a backward is split into B, the
  gradient of the stage's input (what the previous stage waits for), and W, the gradients of its weights (what
  nobody waits for). Stage s runs 1F1B's warm-up, then s rounds of F and B with their W held back, then F B W in
  turn, then B W, and finally the s W's it held back: they fill the cool-down, where 1F1B's stages sit idle. With
  F, B and W one tick each, the bubble falls from 3(P - 1) ticks to P - 1 (with M >= P), while every stage holds at
  most P micro-batches, 1F1B's first stage's peak.
- Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual pipeline): each rank holds V chunks of blocks,
  not one contiguous stage; chunk c of rank s is virtual stage c P + s, so a micro-batch goes round the ranks V
  times. Forwards run in groups of P micro-batches, chunk by chunk; a rank warms up with 2(P - s - 1) + (V - 1) P
  forwards, then alternates, then drains. An action is 1/V of a stage's work, so the ramp at either end is V times
  shorter: the bubble is (P - 1) / (V M + P - 1), for V times the point-to-point messages. M must be a multiple of P.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward, "B" backward (without W in the schedule: all of it), "W" its weights' gradients
    microbatch: int
    chunk: int = 0  # interleaved: which of the rank's chunks (virtual stage chunk x P + rank)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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


def zero_bubble(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1: 1F1B with each backward split into B and W, stage s holding back s W's to its cool-down."""
    _check(stages, microbatches)
    schedule = []
    for s in range(stages):
        M, f, b, w = microbatches, 0, 0, 0
        actions = []

        def run(kind: str) -> None:
            nonlocal f, b, w
            m = {"F": f, "B": b, "W": w}[kind]
            actions.append(Action(kind, m))
            f, b, w = f + (kind == "F"), b + (kind == "B"), w + (kind == "W")

        for _ in range(min(stages - s - 1, M)):
            run("F")
        for _ in range(min(s, M - f)):  # W held back: it waits for the cool-down
            run("F"), run("B")
        while f < M:
            run("F"), run("B"), run("W")
        while b < M:
            run("B"), run("W")
        while w < M:
            run("W")
        schedule.append(actions)
    return schedule


def interleaved(stages: int, microbatches: int, virtual: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B over `virtual` chunks per rank (see the module docstring); M a multiple of P."""
    _check(stages, microbatches)
    if virtual < 2 or microbatches % stages:
        raise ValueError(f"the interleaved schedule needs 2 or more virtual stages (got {virtual}) and micro-batches "
                         f"a multiple of the {stages} stages (got {microbatches})")
    P, total = stages, virtual * microbatches

    def forward(k: int) -> Action:  # the k-th forward of a rank: groups of P micro-batches, chunk by chunk
        return Action("F", (k // (P * virtual)) * P + k % P, (k // P) % virtual)

    def backward(k: int) -> Action:  # ...and backwards in the same groups, the chunks in reverse
        f = forward(k)
        return Action("B", f.microbatch, virtual - 1 - f.chunk)

    schedule = []
    for s in range(stages):
        warmup = total if microbatches == P else min(2 * (P - s - 1) + (virtual - 1) * P, total)
        actions = [forward(k) for k in range(warmup)]
        for i in range(total - warmup):
            actions += [forward(warmup + i), backward(i)]
        actions += [backward(i) for i in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zero-bubble": zero_bubble, "interleaved": interleaved}


def make_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """The lists of schedule `name`: interleaved over `virtual` chunks per rank, the others over one."""
    if name == "interleaved":
        return interleaved(stages, microbatches, virtual)
    if virtual != 1:
        raise ValueError(f"virtual stages ({virtual}) are for the interleaved schedule, not {name}")
    return SCHEDULES[name](stages, microbatches)


def virtual_stages(schedule: list[list[Action]]) -> int:
    """Chunks per rank: 1 but for an interleaved schedule."""
    return 1 + max(a.chunk for a in schedule[0])


def splits_backward(schedule: list[list[Action]]) -> bool:
    """Whether the schedule runs each backward as B then W."""
    return any(a.kind == "W" for a in schedule[0])


def _check(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a pipeline needs at least 1 stage and 1 micro-batch (got {stages} and {microbatches})")


def expected_bubble(stages: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """Share of a step each stage idles: (P - 1) / (M + P - 1) in GPipe and 1F1B; in zero-bubble, with F, B and W
    of one tick each and M >= P, (P - 1) / (3M + P - 1); interleaved over V chunks, (P - 1) / (V M + P - 1)."""
    P, M = stages, microbatches
    if schedule == "zero-bubble":
        return (P - 1) / (3 * M + P - 1)
    return (P - 1) / (virtual * M + P - 1) if schedule == "interleaved" else (P - 1) / (M + P - 1)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward has run and whose backward (its W, when split) has not, at any point of a
    stage's list: the activations the stage must hold at once."""
    last = "W" if any(a.kind == "W" for a in actions) else "B"
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1 if a.kind == last else 0
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


def costs(schedule: list[list[Action]], forward_cost: int, backward_cost: int) -> dict[str, int]:
    """Ticks per kind of action: a backward takes backward_cost, split into B and W by a zero-bubble schedule (W
    the half of it, rounded down; B the rest)."""
    if not splits_backward(schedule):
        return {"F": forward_cost, "B": backward_cost}
    if backward_cost < 2:
        raise ValueError(f"a zero-bubble schedule splits each backward into B and W: a backward of {backward_cost} "
                         "tick cannot be split; give it 2 ticks or more")
    return {"F": forward_cost, "B": backward_cost - backward_cost // 2, "W": backward_cost // 2}


def simulate(schedule: list[list[Action]], forward_cost: int = 1, backward_cost: int = 1) -> list[Slot]:
    """Play a schedule on an ideal clock: each stage runs its actions in order, each as soon as its
    input exists: F(s, m) after F(s - 1, m); B(s, m) after B(s + 1, m) (the last stage: after its own
    F(s, m)); W(s, m) after B(s, m). Interleaved, s is the virtual stage, chunk x P + rank. Communication is free.
    Raises DeadlockError if the stages wait on each other in a circle."""
    stages, cost = len(schedule), costs(schedule, forward_cost, backward_cost)
    last = stages * virtual_stages(schedule) - 1  # the last virtual stage
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> finish time
    position, clock, slots = [0] * stages, [0] * stages, []
    while any(position[s] < len(schedule[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(schedule[s]):
                continue
            a = schedule[s][position[s]]
            v = a.chunk * stages + s
            if a.kind == "F":
                needs = ("F", v - 1, a.microbatch) if v > 0 else None
            elif a.kind == "W":
                needs = ("B", v, a.microbatch)
            else:
                needs = ("B", v + 1, a.microbatch) if v < last else ("F", v, a.microbatch)
            if needs is not None and needs not in done:
                continue
            start = max(clock[s], done[needs] if needs else 0)
            stop = start + cost[a.kind]
            done[(a.kind, v, a.microbatch)] = clock[s] = stop
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
    V = virtual_stages(schedule)
    stages, microbatches = len(schedule), sum(a.kind == "F" for a in schedule[0]) // V
    slots, cost = simulate(schedule, forward_cost, backward_cost), costs(schedule, forward_cost, backward_cost)
    span = max(s.stop for s in slots)
    width = len(str(microbatches - 1)) + (4 if V > 1 else 2)  # a kind letter, the micro-batch, its chunk, a space
    grid = [[".".ljust(width)] * span for _ in range(stages)]
    for slot in slots:
        for t in range(slot.start, slot.stop):
            grid[slot.stage][t] = str(slot.action).ljust(width)
    bubbles = simulated_bubble(slots, stages)
    split = f" (B {cost['B']} + W {cost['W']})" if "W" in cost else ""
    kinds = "Fn / Bn / Wn" if "W" in cost else "Fn.c / Bn.c: chunk c (.0 not shown)" if V > 1 else "Fn / Bn"
    title = (f"{name}: {stages} stages, {microbatches} micro-batches; a forward takes {forward_cost} tick"
             f"{'s' if forward_cost > 1 else ''}, a backward {backward_cost}{split} ({kinds}: micro-batch n, . idle)")
    lines = [title, ""]
    lines += [f"stage {s} | " + "".join(row).rstrip() for s, row in enumerate(grid)]
    lines += ["", f"{'stage':>5}  {'bubble':>6}  {'in flight (peak)':>16}"]
    for s in range(stages):
        lines.append(f"{s:>5}  {bubbles[s]:>6.1%}  {peak_in_flight(schedule[s]):>16}")
    if "W" in cost:
        lines.append(f"bubble with F = B = W and M >= P: (P-1)/(3M+P-1) = "
                     f"{expected_bubble(stages, microbatches, 'zero-bubble'):.1%} (1f1b at these costs: "
                     f"(P-1)/(M+P-1) = {expected_bubble(stages, microbatches):.1%}); peak in flight: at most P = "
                     f"{stages} on every stage")
    elif V > 1:
        lines.append(f"bubble (P-1)/(VM+P-1) = {expected_bubble(stages, microbatches, 'interleaved', V):.1%} with V = "
                     f"{V} (1f1b: (P-1)/(M+P-1) = {expected_bubble(stages, microbatches):.1%}, each action V times "
                     "longer); in flight counts chunk micro-batches, each 1/V of a stage's activations")
    else:
        lines.append(f"bubble (P-1)/(M+P-1) = {expected_bubble(stages, microbatches):.1%}; peak in flight: "
                     f"1f1b min(P-s, M) <= P = {stages}, gpipe M = {microbatches}")
    return "\n".join(lines)
