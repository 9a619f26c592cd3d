"""Parameter servers against data parallel with slowed workers: what bounded staleness buys and costs.

Two workers train the same model on the same data for the same steps (the same tokens): data parallel (--zero 0,
2 ranks), then parameter servers (2 workers + 1 server) at K = 0, 1, 2, 4. Two kinds of delay, each --slow-s at the
start of a step: worker 1 at every step (the `slow` fault: one straggler), or the workers in turn, worker 0 at even
steps and worker 1 at odd ones (`slow-turns`: a straggler at every step, never the same one twice). Per run: tokens per second over the training steps (rank 0's wall time, which ends
when the last update has reached it), and the held-out loss of the final parameters (every worker ends on the same
ones), over --val-batches fixed batches. Ratios are to data parallel in the same repeat; figures are median
[min-max] over repeats.

    .venv/bin/python benchmarks/param_server.py [--steps 40] [--slow-s 0.05] [--repeats 3] [--out FILE]
                                                [--plot FILE]

Writes benchmarks/results/param_server.json (or --out) and docs/param-server.png (--plot).
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.data import EvalBatches, load_val
from minitrain.runtime.launch import launch
from minitrain.train.metrics import format_table
from minitrain.train.run_config import run_config

MODEL = {"model.preset": "tiny", "model.d_model": 64, "train.batch_size": 8, "train.log_every": 0}
STALENESS = (0, 1, 2, 4)
DELAYS = {"one slow worker": {"fault.kind": "slow", "fault.rank": 1}, "workers in turn": {"fault.kind": "slow-turns"}}


def held_out_loss(trainer, cfg, batches: int) -> float:
    """The mean loss of the model as it is over the first `batches` held-out batches (this rank alone)."""
    losses = []
    trainer.model.eval()
    with torch.no_grad():
        for x, y in EvalBatches(load_val(cfg), cfg.model.seq_len, cfg.train.batch_size, 0, 1, batches):
            losses.append(float(trainer.strategy.module(x, y)))
    return sum(losses) / len(losses)


def worker(topo, values: dict, val_batches: int) -> dict | None:
    from minitrain.train import loop

    kept = {}
    run = loop.TrainingRun.run

    def run_and_evaluate(self):
        summary = run(self)
        kept["val_loss"] = held_out_loss(self.trainer, self.cfg, val_batches)
        return summary

    loop.TrainingRun.run = run_and_evaluate  # in this rank's process only
    summary = loop.train_worker(topo, run_config(cli_values=values))
    if topo.rank != 0:
        return None
    tokens = summary["steps"] * 2 * MODEL["train.batch_size"] * run_config(cli_values=values).model.seq_len
    return {"tokens_per_s": tokens / summary["elapsed_s"], "val_loss": kept["val_loss"],
            "staleness": (summary.get("parameter_servers") or {}).get("served", [{}])[0].get("staleness_counts")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slow-s", type=float, default=0.05, help="worker 1's sleep at every step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / "param_server.json"), help="the result file")
    parser.add_argument("--plot", default="docs/param-server.png", help="the figure ('' = none)")
    args = parser.parse_args(argv)
    setups = {"data parallel": (2, {})}
    setups.update({f"PS K={k}": (3, {"ps.servers": 1, "ps.staleness": k}) for k in STALENESS})
    report, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="minitrain-ps-") as scratch:
        for delay, fault in DELAYS.items():
            runs = []
            for r in range(args.repeats):
                runs.append({})
                for name, (world, extra) in setups.items():
                    values = {**MODEL, **extra, **fault, "dist.nproc": world, "train.steps": args.steps,
                              "fault.step": 1, "fault.slow_s": args.slow_s,
                              "out": f"{scratch}/{delay}-{r}-{name}".replace(" ", "_")}
                    runs[-1][name] = launch(worker, world, values, args.val_batches, backend="gloo",
                                            timeout_s=1800)[0]
                print(f"{delay}, repeat {r + 1}: " + ", ".join(f"{n} {run['tokens_per_s']:,.0f} tok/s"
                                                               for n, run in runs[-1].items()), file=sys.stderr,
                      flush=True)
            report[delay] = {}
            for name in setups:
                entry = {"tokens_per_s": median_range([run[name]["tokens_per_s"] for run in runs]),
                         "vs_data_parallel": median_range([run[name]["tokens_per_s"]
                                                           / run["data parallel"]["tokens_per_s"] for run in runs]),
                         "val_loss": median_range([run[name]["val_loss"] for run in runs]),
                         "staleness_counts": runs[0][name]["staleness"]}
                report[delay][name] = entry
                rows.append([delay, name, f"{entry['tokens_per_s'][0]:,.0f}",
                             fmt_range(entry["vs_data_parallel"], "{:.2f}"), fmt_range(entry["val_loss"], "{:.4f}")])
    out = write_result(args.out, __file__, argv,
                       {"steps": args.steps, "slow_s": args.slow_s, "repeats": args.repeats, "workers": 2,
                        "model": MODEL, "val_batches": args.val_batches,
                        "format": "each figure is [median, min, max] over repeats", "results": report})
    print(format_table(["delays", "setup", "tokens/s", "vs data parallel", "held-out loss"], rows, "<<>>>"))
    if args.plot:
        plot(report, args.plot, args)
    print(f"wrote {out}")
    return 0


def plot(report: dict, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(report)
    for i, (delay, by_setup) in enumerate(report.items()):
        names = list(by_setup)
        for ax, key in zip(axes, ("vs_data_parallel", "val_loss")):
            median = [by_setup[n][key][0] for n in names]
            errors = [[m - by_setup[n][key][1] for n, m in zip(names, median)],
                      [by_setup[n][key][2] - m for n, m in zip(names, median)]]
            ax.bar([x + i * width for x in range(len(names))], median, width, yerr=errors, label=delay)
            ax.set_xticks([x + width * (len(report) - 1) / 2 for x in range(len(names))], names, rotation=20)
    axes[0].set_title("tokens/s, relative to data parallel", fontsize=10)
    axes[1].set_title(f"held-out loss after {args.steps} steps (the same tokens)", fontsize=10)
    losses = [e["val_loss"] for by_setup in report.values() for e in by_setup.values()]
    axes[1].set_ylim(min(v[1] for v in losses) - 0.02, max(v[2] for v in losses) + 0.02)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"2 workers, a {args.slow_s:g} s sleep per delayed step (median [min-max] of {args.repeats})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
