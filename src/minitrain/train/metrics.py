"""Per-step metrics as JSON lines (rank 0 writes), and the text tables rank 0 prints."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from ..errors import ConfigError


START_OVER = "start over"  # the event line that begins a new segment of a metrics.jsonl


def open_no_follow(path: Path, mode: str = "a"):
    """A run file opened for writing without following a symbolic link (one planted in --out could point at any
    file, which the run would then append to or truncate): ConfigError if it is a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    try:
        return os.fdopen(os.open(path, flags, 0o644), mode)
    except OSError:
        if os.path.islink(path):
            raise ConfigError(f"{path} is a symbolic link; minitrain writes its run files itself: remove the link")
        raise


class MetricsWriter:
    """Appends one JSON object per step to OUT/metrics.jsonl, flushed at once so a
    crash loses nothing already logged.

    A run that starts from step 0 where an earlier attempt logged lines but saved no checkpoint (--resume auto
    found none) keeps them: it writes a "start over" event line and its own lines after it (readers take, for a
    step logged twice, the later line). A resume keeps the lines up to its checkpoint's step."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if os.path.islink(self.path):
            raise ConfigError(f"{self.path} is a symbolic link; minitrain writes its run files itself: remove the link")
        earlier = self.path.exists() and self.path.stat().st_size > 0
        if resume_step is not None and earlier:
            self._truncate_after(resume_step)
        self._file = open_no_follow(self.path)
        if resume_step is None and earlier:
            self.write({"event": START_OVER, "time": time.time(), "note": "no checkpoint to resume from: the lines "
                        "above are an earlier attempt's, kept"})

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines of the current segment for steps after the checkpoint: they will be redone."""
        lines = self.path.read_text().splitlines()
        start = max((i for i, line in enumerate(lines) if f'"{START_OVER}"' in line), default=-1) + 1
        kept = lines[:start]
        for line in lines[start:]:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a crash
        with open_no_follow(self.path, "w") as f:
            f.write("".join(line + "\n" for line in kept))

    def rewind(self, step: int) -> None:
        """After a rollback to `step`: drop the lines after it, which are about to be redone."""
        self._file.close()
        self._truncate_after(step)
        self._file = open_no_follow(self.path)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def best_val_loss(path: str | os.PathLike) -> tuple[float, int] | None:
    """(lowest val_loss, its step) among the step lines of a metrics.jsonl, or None: a resumed run's best
    so far is in the lines of the steps before it."""
    best = None
    lines = Path(path).read_text().splitlines() if Path(path).exists() else []
    start = max((i for i, line in enumerate(lines) if f'"{START_OVER}"' in line), default=-1) + 1
    for line in lines[start:]:  # an earlier attempt's, before a start over, are not this run's
        try:
            record = json.loads(line)
            loss = record.get("val_loss")
        except (json.JSONDecodeError, AttributeError):
            continue  # a line cut short by a crash
        if isinstance(loss, (int, float)) and (best is None or loss < best[0]):
            best = (float(loss), int(record["step"]))
    return best


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile q (0-100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def distribution(values: list[float]) -> dict[str, float]:
    """mean, p50 and p95 of a non-empty list."""
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p95": percentile(values, 95)}


def sync_report(syncs: list[dict], warmup: int) -> dict[str, dict[str, float]]:
    """Gradient-sync distributions (ms, and overlap as a fraction) over the steps after warmup,
    from the `sync` field of step records."""
    measured = syncs[warmup:] or syncs
    report = {}
    for key, scale in (("allreduce_inflight_s", 1000), ("sync_exposed_s", 1000), ("overlap", 1)):
        values = [s[key] * scale for s in measured if s.get(key) is not None]
        if values:
            name = key.removesuffix("_s") + ("_ms" if scale == 1000 else "")
            report[name] = distribution(values)
    return report


def phase_report(phases: list[dict | None], warmup: int) -> dict[str, dict[str, float]]:
    """Where the steps after warmup went, from the `phases_s` field of step records: per phase the mean
    ms a step and its share of the step (phases a step does not have are left out)."""
    measured = [p for p in phases[warmup:] or phases if p]
    if not measured:
        return {}
    means = {name: sum(p[name] for p in measured) / len(measured)
             for name in measured[0] if measured[0][name] is not None}
    total = sum(means.values()) or 1.0
    return {name: {"ms": 1000 * mean, "share": mean / total} for name, mean in means.items()}


def straggler_report(busy: list[list[float] | None], warmup: int, factor: float) -> dict | None:
    """From the `busy_s_per_rank` of step records: per rank the median and p95 busy ms after warmup, the
    slowest rank and how many times the other ranks' median it is; `straggler` is that rank when the ratio
    exceeds `factor` (0: never), else None. None for one rank."""
    measured = [b for b in busy[warmup:] or busy if b]
    if not measured or len(measured[0]) < 2:
        return None
    per_rank = [[1000 * step[r] for step in measured] for r in range(len(measured[0]))]
    p50 = [percentile(values, 50) for values in per_rank]
    slowest = max(range(len(p50)), key=p50.__getitem__)
    others = percentile([v for r, v in enumerate(p50) if r != slowest], 50)
    ratio = p50[slowest] / others if others > 0 else math.inf
    return {"busy_ms_p50": p50, "busy_ms_p95": [percentile(values, 95) for values in per_rank],
            "slowest": slowest, "ratio": ratio, "straggler": slowest if factor and ratio > factor else None}


def straggler_line(report: dict) -> str:
    """e.g. 'busy per step (median ms): r0 12.1, r1 210.3; straggler: rank 1, 17.4x the other ranks' median'"""
    p50 = report["busy_ms_p50"]
    ranks = (", ".join(f"r{r} {v:.1f}" for r, v in enumerate(p50)) if len(p50) <= 8 else
             f"min {min(p50):.1f}, median {percentile(p50, 50):.1f}, max {max(p50):.1f}")
    verdict = (f"straggler: rank {report['straggler']}, {report['ratio']:.1f}x the other ranks' median"
               if report["straggler"] is not None else f"no straggler (slowest rank {report['slowest']}, "
               f"{report['ratio']:.2f}x the others)")
    return f"busy per step, per rank (median ms): {ranks}; {verdict}"


def phase_line(report: dict[str, dict[str, float]]) -> str:
    """e.g. 'forward 31.0 ms (25%), backward 62.1 ms (50%), ...'"""
    return ", ".join(f"{name} {d['ms']:.1f} ms ({d['share']:.0%})" for name, d in report.items())


def perplexity(loss: float) -> str:
    """exp(loss) for a progress line: one decimal, or three significant digits once it is large."""
    value = math.exp(min(loss, 700.0))  # exp overflows past ~709
    return f"{value:.1f}" if value < 1e5 else f"{value:.3g}"


def clock(seconds: float) -> str:
    """A duration as h:mm:ss, e.g. 0:03:07."""
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A plain monospace table; `align` is one of '<' or '>' per column (default: right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ">" * len(headers)
    lines = ["  ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
