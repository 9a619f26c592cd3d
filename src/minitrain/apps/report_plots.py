"""`minitrain report`'s plots: one PNG per quantity, one line per run, and report.png with them all.

matplotlib is imported inside write_plots: `minitrain --help` imports this module and must stay fast.
"""
from __future__ import annotations

import math
from pathlib import Path

from .report_data import Run, _finite, rank_count, rank_peak

# Each panel draws every run on one Axes and returns whether it drew anything, so a quantity no run
# recorded is left out rather than drawn as an empty frame.

def _plot(ax, x: list[float], y: list[float], **style) -> bool:
    points = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    if not points:
        return False
    ax.plot(*zip(*points), **style)
    return True


def draw_loss(ax, runs: list[Run]) -> bool:
    drew = False
    for i, run in enumerate(runs):
        tokens = run.values("tokens_seen")
        drew |= _plot(ax, tokens, run.values("loss"), color=f"C{i}", label=f"{run.label} train")
        # Validation runs every few steps only: markers show where, a dashed line the trend.
        drew |= _plot(ax, tokens, run.values("val_loss"), color=f"C{i}", linestyle="--", marker="o",
                      markersize=4, label=f"{run.label} val")
    ax.set(title="loss", xlabel="tokens seen", ylabel="loss")
    return drew


def _per_step(key: str, title: str, ylabel: str, log: bool = False):
    def draw(ax, runs: list[Run]) -> bool:
        drew = False
        for i, run in enumerate(runs):
            drew |= _plot(ax, run.values("step"), run.values(key), color=f"C{i}", label=run.label)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        values = [v for run in runs for v in _finite(run.values(key)) if v > 0]
        if log and values and max(values) > 10 * min(values):  # early spikes would flatten the rest
            ax.set_yscale("log")
        return drew
    return draw


def draw_memory(ax, runs: list[Run]) -> bool:
    ranks = [rank_count(run.steps) for run in runs]
    drew = False
    for i, run in enumerate(runs):
        for rank in range(ranks[i]):
            mib = [rank_peak(s, rank) / 2**20 for s in run.steps]
            # One colour per run, a line style per rank; with many lines, one legend entry per run.
            label = (f"{run.label} rank {rank}" if sum(ranks) <= 10 else
                     f"{run.label} (all ranks)" if rank == 0 else None)
            drew |= _plot(ax, run.values("step"), mib, color=f"C{i}", linestyle=("-", "--", ":", "-.")[rank % 4],
                          label=label)
    ax.set(title="peak tracked memory per rank (params + grads + optimizer)", xlabel="step", ylabel="MiB")
    return drew


def draw_comm_share(ax, runs: list[Run]) -> bool:
    drew = False
    for i, run in enumerate(runs):
        share = [100 * c / t if t > 0 else math.nan for c, t in zip(run.values("comm_time_s"), run.values("step_time_s"))]
        drew |= _plot(ax, run.values("step"), share, color=f"C{i}", label=run.label)
    ax.set(title="communication share of step time", xlabel="step", ylabel="%")
    return drew


def draw_expert_load(ax, runs: list[Run]) -> bool:
    """A mixture of experts' balance: each step's busiest expert against the mean, at each MoE layer (1 is
    perfectly balanced)."""
    drew = False
    for i, run in enumerate(runs):
        layers = max((len(s.get("expert_load") or []) for s in run.steps), default=0)
        for layer in range(layers):
            ratio = []
            for s in run.steps:
                load = (s.get("expert_load") or [])[layer][:-1] if layer < len(s.get("expert_load") or []) else []
                ratio.append(max(load) * len(load) / sum(load) if load and sum(load) else math.nan)
            label = f"{run.label} layer {layer}" if layers <= 6 else (run.label if layer == 0 else None)
            drew |= _plot(ax, run.values("step"), ratio, color=f"C{i}", linestyle=("-", "--", ":", "-.")[layer % 4],
                          label=label)
    ax.set(title="expert load: busiest / mean", xlabel="step", ylabel="max / mean")
    return drew


PANELS = {  # file stem -> drawer, in report.png's order
    "loss": draw_loss,
    "lr": _per_step("lr", "learning rate", "lr"),
    "grad_norm": _per_step("grad_norm", "gradient norm", "norm", log=True),
    "tokens_per_s": _per_step("tokens_per_s", "throughput", "tokens/s"),
    "memory": draw_memory,
    "comm_share": draw_comm_share,
    "expert_load": draw_expert_load,
}


# Panels of what only some runs record (a mixture of experts' load): a report of runs without it leaves them out
# without a word.
OPTIONAL = {"expert_load"}


def write_plots(runs: list[Run], out: Path) -> tuple[list[str], list[str]]:
    """One PNG per panel and report.png with all of them; returns (the panels drawn, those left out for lack of
    data). An optional panel no run recorded is in neither."""
    # The Agg canvas directly, not pyplot: no global backend switch, no figure registry to leak into.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def new_figure(**kw):
        fig = Figure(**kw)
        FigureCanvasAgg(fig)
        return fig

    # Fixed margins rather than a tight layout: laying out twice doubles the drawing time.
    panels = {name: draw for name, draw in PANELS.items()
              if name not in OPTIONAL or any(s.get(name) for run in runs for s in run.steps)}
    empty = []
    for name, draw in panels.items():
        fig = new_figure(figsize=(6, 4), dpi=110)
        fig.subplots_adjust(left=0.15, right=0.97, bottom=0.13, top=0.91)
        ax = fig.subplots()
        if draw(ax, runs):
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
            fig.savefig(out / f"{name}.png")
        else:
            empty.append(name)
            (out / f"{name}.png").unlink(missing_ok=True)  # not a stale plot from an earlier report

    rows = math.ceil(len(panels) / 3)
    fig = new_figure(figsize=(16, 4.5 * rows), dpi=90)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.07, top=0.91, wspace=0.25, hspace=0.3)
    axes = list(fig.subplots(rows, 3).flat)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (name, draw) in zip(axes, panels.items()):
        if draw(ax, runs):
            ax.grid(alpha=0.3)
            ax.legend(fontsize="x-small")
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(" vs ".join(run.label for run in runs))
    fig.savefig(out / "report.png")
    return [name for name in panels if name not in empty], empty
