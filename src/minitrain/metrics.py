"""Per-step metrics as JSON lines (rank 0 writes), and the text tables rank 0 prints."""
from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsWriter:
    """Appends one JSON object per step to OUT/metrics.jsonl, flushed at once so a
    crash loses nothing already logged."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif resume_step is None:
            self.path.write_text("")
        self._file = open(self.path, "a")

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines for steps after the checkpoint: they will be redone."""
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a crash
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
