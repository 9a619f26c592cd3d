"""What `minitrain report` reads and says: each run's metrics.jsonl checked and read into a Run, and the per-run
summary and comparison table it prints (the plots are report_plots.py, the command report.py)."""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..train.metrics import format_table, human_bytes, phase_line, phase_report

METRICS = "metrics.jsonl"
WARMUP_STEPS = 5  # the first steps pay for allocation and caches; speed is measured after them
MULTI_RUN_OUT = Path("runs/report")


@dataclass
class Run:
    """One run's metrics: step records (one per step, in step order) and event lines."""

    label: str
    path: Path  # its metrics.jsonl
    steps: list[dict]
    events: list[dict] = field(default_factory=list)
    bad_lines: int = 0  # lines that are not JSON objects (cut short by a crash)
    bad_fields: int = 0  # fields of a step line that are not what minitrain writes there, left out

    def values(self, key: str) -> list[float]:
        """`key` of every step, NaN where a step lacks it, so plots show a gap rather than shift."""
        return [_number(s.get(key)) for s in self.steps]


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def metrics_path(run_dir: str) -> Path:
    """RUN_DIR/metrics.jsonl, or ConfigError saying what is wrong with RUN_DIR. A path to the
    metrics.jsonl itself is accepted too: shells complete file names."""
    path = Path(run_dir)
    if path.is_file() and path.suffix == ".jsonl":
        return path
    if not path.exists():
        raise ConfigError(f"run directory {run_dir} does not exist; give the --out of a `minitrain train` run")
    if not path.is_dir():
        raise ConfigError(f"{run_dir} is not a directory; give the --out of a `minitrain train` run")
    if not (path / METRICS).is_file():
        raise ConfigError(f"{run_dir} holds no {METRICS}; give the --out of a `minitrain train` run")
    return path / METRICS


def read_run(path: Path, label: str) -> Run:
    """Parse metrics.jsonl. Robust to what real files hold: a last line cut short by a crash, event lines
    (rollbacks) among the steps, and a step logged twice (the last one is what the run kept)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    by_step: dict[int, dict] = {}
    events, bad, malformed = [], 0, 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if not isinstance(record, dict):
            bad += 1
        elif "event" in record:
            events.append(record)
        elif isinstance(record.get("step"), int) and not isinstance(record["step"], bool):
            malformed += _drop_malformed(record)
            by_step[record["step"]] = record  # a later line for the same step replaces the earlier one
        else:
            bad += 1
    if not by_step:
        raise ConfigError(f"{path} holds no step records ({len(lines)} line(s)); the run stopped before its "
                          "first step, or this is not a minitrain metrics file")
    return Run(label, path, [by_step[s] for s in sorted(by_step)], events, bad, malformed)


def _is_number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


# The structured fields of a step line, and what each must hold (a field written otherwise is left out).
FIELD_SHAPES = {
    "phases_s": lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()),
    "memory": lambda v: isinstance(v, dict) and all(isinstance(x, list) and all(map(_is_number, x))
                                                     for x in v.values()),
    "busy_s_per_rank": lambda v: isinstance(v, list) and all(map(_is_number, v)),
    "param_norm_per_rank": lambda v: isinstance(v, list) and all(map(_is_number, v)),
    "sync": lambda v: isinstance(v, dict),
    "pipeline": lambda v: isinstance(v, dict),
    # per MoE layer: each expert's slots, then the slots dropped
    "expert_load": lambda v: isinstance(v, list) and all(isinstance(x, list) and len(x) >= 2 and all(map(_is_number, x))
                                                         for x in v),
}
FIELD_SHAPES["memory_peak"] = FIELD_SHAPES["memory"]


def _drop_malformed(record: dict) -> int:
    """Remove the step line's fields that do not hold what minitrain writes there; how many were removed."""
    bad = [key for key, ok in FIELD_SHAPES.items() if record.get(key) is not None and not ok(record[key])]
    for key in bad:
        del record[key]
    return len(bad)


def unique_labels(paths: list[Path]) -> list[str]:
    """Each run is labelled by its directory's name; two runs named alike (runs/x/a and runs/y/a) get
    their parent's name too, and the same directory given twice gets #2."""
    dirs = [p.resolve().parent for p in paths]
    names = [d.name or str(d) for d in dirs]
    shared = {n for n in names if len({d for d, m in zip(dirs, names) if m == n}) > 1}  # by different dirs
    labels = [f"{d.parent.name}/{n}" if n in shared else n for d, n in zip(dirs, names)]
    seen: dict[str, int] = {}
    unique = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return unique


def check_out_dir(out: Path) -> None:
    """Refuse an --out that cannot be written, without creating anything: the nearest existing ancestor
    must be a writable directory."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"cannot write the report to {out}: {existing} is a file, not a directory; choose "
                          "another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write the report to {out}: {existing} is not writable; choose another --out")


# --- the numbers ----------------------------------------------------------------------------------

def measured_steps(steps: list[dict]) -> list[dict]:
    """The steps speed is measured over: after the first WARMUP_STEPS, or all of them in a short run."""
    return steps[WARMUP_STEPS:] or steps


def _finite(values) -> list[float]:
    return [v for v in values if math.isfinite(v)]


@dataclass
class Summary:
    """What the text and the table say about one run; None where the run did not record it."""

    steps: int
    first_step: int
    last_step: int
    tokens_seen: float
    final_loss: float
    best_val: tuple[float, int, float] | None  # loss, step, perplexity
    median_tokens_per_s: float | None
    mean_step_s: float | None
    phases: str
    comm_share: float | None
    peak_per_rank: list[float]  # most bytes memory_peak.total reached, per rank
    skipped: int
    rollbacks: int
    elapsed_s: float | None


def summarise(run: Run) -> Summary:
    steps, measured = run.steps, measured_steps(run.steps)
    last = steps[-1]
    vals = [(_number(s.get("val_loss")), s) for s in steps]
    vals = [(v, s) for v, s in vals if math.isfinite(v)]
    best_val = None
    if vals:
        loss, record = min(vals, key=lambda vs: vs[0])  # the earliest step among equal losses
        ppl = _number(record.get("val_ppl"))
        best_val = (loss, record["step"], ppl if math.isfinite(ppl) else math.exp(min(loss, 700)))
    speeds = _finite(_number(s.get("tokens_per_s")) for s in measured)
    times = _finite(_number(s.get("step_time_s")) for s in measured)
    comm = _finite(_number(s.get("comm_time_s")) for s in measured)
    # The trainer's own warmup for its end-of-run phase line, so the two agree.
    phases = phase_report([s.get("phases_s") for s in steps], warmup=min(WARMUP_STEPS, len(steps) // 5))
    elapsed = _number(last.get("elapsed_s"))
    return Summary(
        steps=len(steps), first_step=steps[0]["step"], last_step=last["step"],
        tokens_seen=_number(last.get("tokens_seen")), final_loss=_number(last.get("loss")), best_val=best_val,
        median_tokens_per_s=statistics.median(speeds) if speeds else None,
        mean_step_s=sum(times) / len(times) if times else None,
        phases=phase_line(phases) if phases else "not recorded",
        comm_share=sum(comm) / sum(times) if comm and times and sum(times) > 0 else None,
        peak_per_rank=peak_memory_per_rank(steps),
        skipped=sum(1 for s in steps if s.get("skipped")),
        rollbacks=sum(1 for e in run.events if e.get("event") == "rollback"),
        elapsed_s=elapsed if math.isfinite(elapsed) else None)


def rank_peak(step: dict, rank: int) -> float:
    """memory_peak.total of one rank in one step record: the most bytes of parameters, gradients and optimizer
    state it held during the step (NaN when not recorded)."""
    totals = (step.get("memory_peak") or {}).get("total") or []
    return _number(totals[rank]) if rank < len(totals) else math.nan


def rank_count(steps: list[dict]) -> int:
    return max(len((s.get("memory_peak") or {}).get("total") or []) for s in steps)


def peak_memory_per_rank(steps: list[dict]) -> list[float]:
    """Per rank, the most bytes memory_peak.total reached over the run."""
    return [max(_finite(rank_peak(s, rank) for s in steps), default=math.nan) for rank in range(rank_count(steps))]


# --- the text -------------------------------------------------------------------------------------

def _or_na(value: float | None, fmt: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)


def best_val_text(best: tuple[float, int, float] | None) -> str:
    if best is None:
        return "no validation"
    loss, step, ppl = best
    return f"{loss:.4f} at step {step} (perplexity {ppl:.2f})"


def _bytes(n: float) -> str:
    return human_bytes(n) if math.isfinite(n) else "n/a"


def memory_text(peaks: list[float]) -> str:
    if not _finite(peaks):
        return "not recorded"
    if len(peaks) <= 8:
        return ", ".join(f"rank {r} {_bytes(b)}" for r, b in enumerate(peaks))
    known = [r for r in range(len(peaks)) if math.isfinite(peaks[r])]  # many ranks: the extremes say enough
    high, low = max(known, key=peaks.__getitem__), min(known, key=peaks.__getitem__)
    return f"{len(peaks)} ranks, most {_bytes(peaks[high])} (rank {high}), least {_bytes(peaks[low])} (rank {low})"


def speed_span(run: Run) -> str:
    """Which steps the speed figures cover, in words."""
    if len(run.steps) <= WARMUP_STEPS:
        return "all steps (too few to leave out warmup)"
    first, last = run.steps[WARMUP_STEPS]["step"], run.steps[-1]["step"]
    return f"{f'step {first}' if first == last else f'steps {first}-{last}'}, after {WARMUP_STEPS} warmup steps"


def run_text(run: Run, s: Summary) -> str:
    rows = [
        ("steps", f"{s.steps} (step {s.first_step} to {s.last_step})"),
        ("tokens seen", _or_na(s.tokens_seen, ",.0f")),
        ("final train loss", _or_na(s.final_loss, ".4f")),
        ("best val loss", best_val_text(s.best_val)),
        ("tokens/s (median)", f"{_or_na(s.median_tokens_per_s, ',.0f')} over {speed_span(run)}"),
        ("mean step time", "n/a" if s.mean_step_s is None else f"{1000 * s.mean_step_s:.1f} ms"),
        ("where a step went", s.phases),
        ("comm share", "n/a" if s.comm_share is None else f"{s.comm_share:.1%} of step time in collectives, overlapped included"),
        ("peak memory", memory_text(s.peak_per_rank)),
        ("skipped steps", str(s.skipped)),
        ("rollbacks", str(s.rollbacks)),
    ]
    if s.elapsed_s is not None:
        rows.insert(2, ("elapsed", f"{s.elapsed_s:.1f} s since the run started"))
    if run.bad_lines:
        rows.append(("unreadable lines", f"{run.bad_lines} (cut short by a crash?), left out"))
    if run.bad_fields:
        rows.append(("malformed fields", f"{run.bad_fields} (not what minitrain writes there), left out"))
    width = max(len(name) for name, _ in rows)
    return "\n".join([f"run {run.label} ({run.path})"] + [f"  {name:<{width}}  {text}" for name, text in rows])


def comparison_table(runs: list[Run], summaries: list[Summary]) -> str:
    headers = ["run", "steps", "tokens", "final loss", "best val", "tok/s p50", "step ms", "comm", "peak mem"]
    rows = [[run.label, s.steps, _or_na(s.tokens_seen, ",.0f"), _or_na(s.final_loss, ".4f"),
             "-" if s.best_val is None else f"{s.best_val[0]:.4f} @{s.best_val[1]}",
             _or_na(s.median_tokens_per_s, ",.0f"),
             "n/a" if s.mean_step_s is None else f"{1000 * s.mean_step_s:.1f}",
             "n/a" if s.comm_share is None else f"{s.comm_share:.1%}",
             _bytes(max(_finite(s.peak_per_rank), default=math.nan))]
            for run, s in zip(runs, summaries)]
    return format_table(headers, rows, align="<" + ">" * (len(headers) - 1))


def summary_text(runs: list[Run]) -> str:
    summaries = [summarise(run) for run in runs]
    parts = [run_text(run, s) for run, s in zip(runs, summaries)]
    if len(runs) > 1:
        parts.append("comparison (peak mem: the most any rank held)\n" + comparison_table(runs, summaries))
    return "\n\n".join(parts) + "\n"
