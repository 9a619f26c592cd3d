"""The benchmark tables of README.md and docs/*.md, rendered from the result files in benchmarks/results/.

    python benchmarks/tables.py          # rewrite every markdown file's generated tables in place
    python benchmarks/tables.py --check  # exit 1, one line per problem, if a file differs from the results

A generated table sits in a markdown file between `<!-- table: NAME -->` and `<!-- /table -->`: the
markdown table and one line naming the result files, the command that wrote them and the machine. NAME
picks the result files and the function that renders them (TABLES at the end). Every known table sits in
exactly one place across README.md and docs/*.md. Text outside the markers is prose and is left alone,
so a benchmark rerun changes the figures there and nowhere by hand.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from ranges import fmt_range  # benchmarks/ranges.py
from record import RESULTS  # benchmarks/record.py

ROOT = RESULTS.parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# A block may be indented (a table inside a list item): its lines carry the marker's indentation.
BLOCK = re.compile(r"^( *)<!-- table: (\S+) -->\n(.*?)^\1<!-- /table -->", re.DOTALL | re.MULTILINE)


def _mib(stats) -> str:
    return f"{stats[0] / 2**20:.1f} MiB"


def _ms(stats) -> str:
    return f"{stats[0]:.0f}"


def _ratio(stats, reference: bool = False) -> str:
    # A row measured against itself has the ratio 1 in every repeat: no range to show.
    return "1.00" if reference else fmt_range(stats, "{:.2f}")


def _percent(stats, digits: int = 0) -> str:
    median, low, high = (100 * x for x in stats)
    return f"{median:.{digits}f}% [{low:.{digits}f}-{high:.{digits}f}%]"


def _median(cell: str) -> str:
    """A 'median [min-max]' cell's median, as the cell shows it."""
    return cell.split(" [")[0]


def _and(items) -> str:
    """'a', 'a and b', 'a, b and c'."""
    items = list(items)
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def _table(header: list[str], align: str, rows: list[list[str]]) -> list[str]:
    """Markdown table lines; align has one '<' (left) or '>' (right) per column."""
    def line(cells):
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    return [line(header), "|" + "|".join("---:" if a == ">" else "---" for a in align) + "|",
            *(line(row) for row in rows)]


def _machine(machine: dict) -> str:
    words = {"cpus": "{} CPUs", "torch": "torch {}", "transformers": "transformers {}", "deepspeed": "DeepSpeed {}",
             "tokenizers": "tokenizers {}", "python": "Python {}"}
    return ", ".join(words.get(key, "{}").format(value) for key, value in machine.items())


def source_line(docs: list[dict]) -> str:
    """Which files the table comes from, by what command, on what machine; files that do not record
    their command or machine say so rather than have one guessed for them."""
    groups: list[tuple[str | None, list[str]]] = []  # consecutive files on the same machine share it
    for doc in docs:
        machine = _machine(doc["machine"]) if "machine" in doc else None
        part = (f"`{doc['path']}`" + (f" from `{doc['command']}`" if "command" in doc else "")
                + (f" ({doc['date']})" if "date" in doc else ""))
        if groups and groups[-1][0] == machine:
            groups[-1][1].append(part)
        else:
            groups.append((machine, [part]))
    texts = []
    for machine, parts in groups:
        if machine:
            texts.append(f"{', '.join(parts)} on {machine}")
        else:
            recorded = any(" from `" in part for part in parts)
            texts.append(f"{', '.join(parts)} ({'machine' if recorded else 'command and machine'} not recorded)")
    return "Source: " + "; ".join(texts) + "."


def prepare_vs_peers(docs: list[dict]) -> list[str]:
    peers = {"ddp": "DDP + AdamW", "zero-redundancy": "DDP + ZeroRedundancyOptimizer",
             "fsdp2-zero2": "FSDP2 (`reshard_after_forward=False`)", "fsdp2": "FSDP2"}
    rows = []
    for ours, entry in docs[0]["results"].items():
        mine, peer = entry[ours], entry[entry["peer"]]
        rows.append([f"ZeRO-{ours[-1]}", peers[entry["peer"]], _ms(mine["step_ms"]), _ms(peer["step_ms"]),
                     _ratio(entry["time_ratio"]), _mib(mine["peak_bytes"]), _mib(peer["peak_bytes"]),
                     _ratio(entry["memory_ratio"])])
    return _table(["ours", "PyTorch peer", "ours ms", "peer ms", "time ratio", "ours peak", "peer peak",
                   "memory ratio"], "<<>><>><", rows)


PEERS = {"ddp": "DDP", "zero-redundancy": "ZeroRedundancyOptimizer", "fsdp2-zero2": "FSDP2, no reshard",
         "fsdp2": "FSDP2"}


def _worlds(docs: list[dict]) -> list[tuple[str, dict]]:
    """(world, its configurations) from one result file, or one per run of some worlds (gpt2-124m: 2 ranks, then
    4): every world in order."""
    worlds = {world: configs for doc in docs for world, configs in doc["results"].items()}
    return sorted(worlds.items(), key=lambda item: int(item[0]))


def zero_stages(docs: list[dict]) -> list[str]:
    rows = []
    for world, configs in _worlds(docs):
        for name, entry in configs.items():
            if "peer" not in entry:
                continue  # a peer's own figures appear in its stage's row
            peer = configs[entry["peer"]]
            # ZeRO-3 is the stage the goals are stated for (docs/zero.md: "Against the goals").
            bold = "**{}**" if name == "zero3" else "{}"
            label = "ZeRO-0 (data parallel)" if name == "zero0" else f"ZeRO-{name[-1]}"
            rows.append([world, bold.format(label), _ms(entry["step_ms"]), _mib(entry["peak_bytes"]),
                         _mib(entry["model_state_peak_bytes"]),
                         f"{PEERS[entry['peer']]} ({_ms(peer['step_ms'])} ms, {_mib(peer['peak_bytes'])})",
                         bold.format(_ratio(entry["time_ratio"])), bold.format(_ratio(entry["memory_ratio"]))])
    return _table(["ranks", "config", "step ms", "peak/rank", "model state peak", "peer", "time vs peer",
                   "peak memory vs peer"], "><>>><>>", rows)


def ddp_modes(docs: list[dict]) -> list[str]:
    labels = {"torch": "torch (PyTorch DDP)", "bucketed": "bucketed (ours)",
              "bucketed-2mb": "bucketed, 2 MiB buckets", "naive": "naive"}
    rows = []
    for model, entry in docs[0]["results"].items():
        for mode, label in labels.items():
            figures = entry[mode]
            rows.append([model, label, f"{figures['step_ms'][0]:.1f}",
                         _ratio(figures["ratio_to_torch"], reference=mode == "torch"),
                         _percent(figures["scaling_efficiency_2v1"])])
        rows.append([model, "machine ceiling", "", "", _percent(entry["ceiling_2v1"])])
    return _table(["model", "mode", "step ms (2 ranks)", "vs torch DDP", "2-vs-1 efficiency"], "<<>>>", rows)


def activation_checkpointing(docs: list[dict]) -> list[str]:
    rows = []
    for mode, entry in docs[0]["results"].items():
        none = mode == "none"
        rows.append([mode, _mib(entry["stored_bytes"]), _ratio(entry["stored_ratio"], none),
                     _mib(entry["peak_bytes"]), _ratio(entry["peak_ratio"], none),
                     _ms(entry["step_ms"]), _ratio(entry["time_ratio"], none)])
    return _table(["mode", "stored activations", "vs none", "peak in step", "vs none", "step ms", "vs none"],
                  "<>>>>>>", rows)


def offload(docs: list[dict]) -> list[str]:
    rows = []
    for preset, entry in docs[0]["results"].items():
        state = f"{entry['state_bytes'] / 2**20:.1f} MiB"
        planned = entry.get("plan_disk_bytes")
        for mode, figures in entry["modes"].items():
            none = mode == "none"
            plan = f"{planned / 2**20:.1f} MiB" if mode == "disk" and planned is not None else ""
            rows.append([preset, mode, _ms(figures["step_ms"]), _ratio(figures["time_ratio"], none),
                         _mib(figures["anon_bytes"]), "" if none else _mib(figures["anon_saved_bytes"]), state, plan])
    return _table(["preset", "offload", "step ms", "vs none", "anonymous memory added", "saved vs none",
                   "optimizer state", "plan: off the device"], "<<>>>>>>", rows)


def tensor_parallel(docs: list[dict]) -> list[str]:
    rows = [[str(doc["tp"]), fmt_range(doc["results"]["minitrain"]["step_ms"], "{:.0f}"),
             fmt_range(doc["results"]["dtensor"]["step_ms"], "{:.0f}"), _ratio(doc["minitrain_over_dtensor"])]
            for doc in sorted(docs, key=lambda doc: doc["tp"])]
    return _table(["tp", "minitrain ms", "DTensor ms", "minitrain / DTensor"], ">>>>", rows)


def pipeline(docs: list[dict]) -> list[str]:
    rows = [[str(doc["pp"]), str(doc["microbatches"]), fmt_range(doc["results"]["minitrain"]["step_ms"], "{:.0f}"),
             fmt_range(doc["results"]["torch"]["step_ms"], "{:.0f}"), _ratio(doc["minitrain_over_torch"])]
            for doc in sorted(docs, key=lambda doc: (doc["pp"], doc["microbatches"]))]
    return _table(["pp", "micro-batches", "minitrain ms", "PyTorch ms", "minitrain / PyTorch"], ">>>>>", rows)


def comm(docs: list[dict]) -> list[str]:
    docs = sorted(docs, key=lambda doc: doc["world_size"])
    largest = {doc["world_size"]: next(iter(doc["ops"].values()))["sizes_bytes"][-1] for doc in docs}
    header = ["op", *(f"alpha, {doc['world_size']} ranks" for doc in docs),
              *(f"beta, {doc['world_size']} ranks" for doc in docs),
              *(f"{largest[doc['world_size']] / 2**20:.0f} MiB busbw, {doc['world_size']} ranks" for doc in docs)]
    rows = []
    for op in docs[0]["ops"]:
        figures = [doc["ops"][op] for doc in docs]
        rows.append([op, *(f"{1e6 * f['alpha_s']:.0f} us" for f in figures),
                     *(f"{f['beta_Bps'] / 1e9:.2f} GB/s" for f in figures),
                     *(f"{f['busbw_Bps'][-1] / 1e9:.2f} GB/s" for f in figures)])
    return _table(header, "<" + ">" * (3 * len(docs)), rows)


def precision_memory(docs: list[dict]) -> list[str]:
    results = docs[0]["results"]

    def formula(entry) -> str:
        return " / ".join(entry["formula"][kind].replace("*", "") for kind in ("params", "grads", "optimizer"))

    rows = []
    for zero in range(4):
        fp32, bf16 = results[f"fp32/zero{zero}"], results[f"bf16/zero{zero}"]
        rows.append([str(zero), formula(fp32), formula(bf16),
                     f"{sum(fp32['bytes'].values()) / 1e6:.1f} MB -> {sum(bf16['bytes'].values()) / 1e6:.1f} MB"])
    return _table(["ZeRO", "fp32: params / grads / optimizer", "bf16 (reduce fp32): params / grads / optimizer",
                   "total fp32 -> bf16"], "<<<<", rows)


def torchrun_restarts(docs: list[dict]) -> list[str]:
    docs = sorted(docs, key=lambda doc: doc["label"] == "now")  # the code as it was first, then as it is
    settings = {"static (default)": ("static (the default)", ""),
                "static, no shared store": ("static", "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`"),
                "c10d --standalone": ("c10d, `--standalone`", ""),
                "c10d --standalone, no shared store": ("c10d, `--standalone`", "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`")}

    def cell(trials: list[dict]) -> str:
        hung = sum(t["rc"] == "timeout" for t in trials)
        return f"{sum(t['passed'] for t in trials)}/{len(trials)}" + (f" ({hung} hung to the limit)" if hung else "")

    def column(label: str) -> str:
        return "now" if label == "now" else f"{label.split('-')[0]} (`{label.split('-', 1)[1]}`)"

    rows = [[rendezvous, env, *(cell(doc["results"][name]) for doc in docs)]
            for name, (rendezvous, env) in settings.items()]
    return _table(["torchrun rendezvous", "env", *(column(doc["label"]) for doc in docs)], "<<" + ">" * len(docs), rows)


def chaos_campaigns(docs: list[dict]) -> list[str]:
    """One row per campaign (tools/chaos.py, a seed each): what it survived, what it redid, how long it took to
    train again."""
    def seconds(values) -> str:
        return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "n/a"

    rows = []
    for doc in sorted(docs, key=lambda d: d["seed"]):
        recoveries = [f["recovery_s"] for f in doc["faults"] if f["recovery_s"] is not None]
        rows.append([str(doc["seed"]), str(doc.get("nodes", 1)), str(doc["steps"]), f"{doc['survived']} of {len(doc['faults'])}",
                     str(len({f["kind"] for f in doc["faults"]})), str(doc["launches"]), str(doc["recomputed_steps"]),
                     seconds(recoveries), f"{doc['checkpoints_written']} ({doc['checkpoint_bytes_written'] / 2**20:.0f} MiB)",
                     "bit for bit" if doc["passed"] else "FAILED: " + "; ".join(doc["failures"]),
                     f"{doc['seconds'] / 60:.1f}"])
    return _table(["seed", "nodes", "steps", "faults survived", "kinds", "launches", "steps recomputed",
                   "recovery s (median / worst)", "checkpoints written", "end against the uninterrupted run",
                   "minutes"], ">>>>>>>><<>", rows)


def chaos_faults(docs: list[dict]) -> list[str]:
    """The same campaigns by kind of fault: how often drawn, the steps redone and the seconds to the next step."""
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        for f in doc["faults"]:
            by_kind.setdefault(f["kind"], []).append(f)
    rows = []
    for kind, faults in sorted(by_kind.items()):
        recomputed = [f["recomputed"] for f in faults if f["recomputed"] is not None]
        recoveries = [f["recovery_s"] for f in faults if f["recovery_s"] is not None]
        rows.append([f"`{kind}`", str(len(faults)), f"{sum(f['fired_at'] is not None for f in faults)}",
                     f"{statistics.median(recomputed):g} / {max(recomputed)}" if recomputed else "n/a",
                     f"{statistics.median(recoveries):.1f} / {max(recoveries):.1f}" if recoveries else "n/a"])
    return _table(["fault", "drawn", "fired", "steps recomputed (median / worst)", "recovery s (median / worst)"],
                  "<>>>>", rows)


def _passed(trials: list[dict]) -> str:
    return f"{sum(t['passed'] for t in trials)}/{len(trials)}"


def _spread(values: list[float]) -> str:
    values = sorted(values)
    return fmt_range((values[len(values) // 2], values[0], values[-1]), "{:.1f}") if values else "n/a"


def _elastic_seconds(trials: list[dict], key: str) -> str:
    """The spread of `key` (recovery_s, regrow_s) over the elastic trials that recovered."""
    return _spread([t[key] for t in trials if "recovery_s" in t])


def multinode(docs: list[dict]) -> list[str]:
    doc = docs[0]
    lines = []
    for kind, exact in doc["exactness"].items():
        aborted = sum(bool(r.get("aborted_in_teardown")) for r in exact)
        walls = sorted(r["wall_s"] for r in exact)
        lines.append(f"- {kind} rendezvous: **{_passed(exact)}** two-node jobs "
                     f"passed (every agent exit 0, {aborted} aborted in teardown, both final checkpoints "
                     f"byte-equal to one machine's); median wall {walls[len(walls) // 2]:.1f} s a job.")
    lines.append("")
    rows = []
    for name, trials in doc["elastic"].items():
        worst = max((t["max_abs_diff_vs_uninterrupted"] for t in trials if "recovery_s" in t), default=float("nan"))
        rows.append([name, f"`{doc['rdzv_conf'][name]}`" if doc["rdzv_conf"][name] else "", _passed(trials),
                     _elastic_seconds(trials, "recovery_s"), _elastic_seconds(trials, "regrow_s"), f"{worst:.1e}"])
    return [*lines, *_table(["rendezvous", "--rdzv-conf", "passed", "recovery s", "regrow s",
                             "final vs never resized (max abs)"], "<<>>>>", rows)]


def _vs_plain(r: dict) -> str:
    """One throughput run's ours / plain: its ratio [its rounds' lowest-highest]."""
    per_round = [x["ours"] / x["plain"] for x in r["rounds"]]
    return fmt_range((r["ratio"], min(per_round), max(per_round)), "{:.3f}")


def _mfu(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def throughput(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = []
    for r in (r for d in docs for r in d["results"]):
        rows.append([r["preset"], r["precision"], str(r["batch_size"]), "yes" if r["compile"] else "no",
                     "late" if r.get("late_stats") else "at once",
                     f"{r['tokens_per_s']:,.0f}",
                     f"{r['plain_tokens_per_s']:,.0f}",
                     _vs_plain(r), f"{r['step_ms']:.2f}", f"{r['plain_step_ms']:.2f}", _mfu(r["mfu"]),
                     _mfu(r["plain_mfu"])])
    return [f"Device: {doc['device']}; MFU peak: {doc['results'][0]['peak_source']}.", "",
            *_table(["preset", "precision", "batch", "compile", "statistics read", "ours tok/s", "plain tok/s",
                     "ours / plain", "ours ms", "plain ms", "MFU", "plain MFU"], "<<><<>>>>>>>", rows)]


def throughput_alternating(docs: list[dict]) -> list[str]:
    """benchmarks/throughput.py run from two trees by turns, each run a file named
    throughput_alternating[_gpu]_r<run>_<tree>.json (<tree>: `before-<commit>` or `now`): one row per run, in the
    order they ran, and each tree's median of the runs' ratios."""
    rows, ratios = [], {}
    for doc in sorted(docs, key=lambda d: _alternating_name(d)[0]):
        run, tree = _alternating_name(doc)[1:]
        for r in doc["results"]:
            ratios.setdefault(tree, []).append(r["ratio"])
            rows.append([run, tree, f"{r['preset']}/{r['precision']}", f"{r['tokens_per_s']:,.0f}",
                         f"{r['plain_tokens_per_s']:,.0f}", _vs_plain(r), f"{r['step_ms']:.1f}",
                         f"{r['plain_step_ms']:.1f}"])
    medians = "; ".join(f"{tree} {statistics.median(values):.3f} (of {len(values)} runs)"
                        for tree, values in ratios.items())
    return [f"Device: {docs[0]['device']}. Median ours / plain over the runs: {medians}.", "",
            *_table(["run", "tree", "config", "ours tok/s", "plain tok/s", "ours / plain", "ours ms", "plain ms"],
                    "><<>>>>>", rows)]


def step_costs(docs: list[dict]) -> list[str]:
    """benchmarks/step_costs.py: the parts of a one-process step besides forward and backward, ms per step."""
    doc = docs[0]
    ms = doc["ms"]
    parts = [("stats.begin", "statistics: `begin` (clocks, collectives so far, memory peaks reset)"),
             ("stats.issue", "statistics: `issue` (memory figures, the row, the exchange)"),
             ("stats.param_norm", "statistics: `issue`, of which the parameter norm"),
             ("stats.pack", "statistics: `issue`, of which packing the row"),
             ("stats.read", "statistics: `read` (the rows into the record)"),
             ("stats", "statistics, in all"),
             ("zero_grad", "gradients zeroed"),
             ("update", "clip and update"),
             ("step", "the whole step")]
    sides = ("every_step", "log_steps", "plain")
    rows = [[label, *(f"{ms[side][key]:.2f}" if key in ms[side] else "" for side in sides)] for key, label in parts]
    rows.append(["statistics' share of the step", *(f"{100 * ms[side]['stats_share']:.1f}%" for side in sides[:2]),
                 ""])
    heading = (f"Device: {doc['device']}; `{doc['preset']}` ({doc['params']:,} parameters) in float32, medians of "
               f"{doc['steps']} steps after {doc['warmup']}, the three sides by turns.")
    return [heading, "",
            *_table(["part of the step (ms)", "ours, parameter norm every step", "ours, on the log steps only",
                     "plain loop"], "<>>>", rows)]


def _alternating_name(doc: dict) -> tuple[tuple[int, int], str, str]:
    """(sort key: run, then the tree before the one after it; run; tree) from the file's name (..._r<run>_<tree>)."""
    run, tree = re.search(r"_r(\d+)_([^_]+)$", Path(doc["path"]).stem).groups()
    return (int(run), not tree.startswith("before")), run, tree


def before_after(docs: list[dict]) -> list[str]:
    doc = docs[0]
    def name(metric: str) -> str:
        if metric == "optimizer_ms":
            return "FlatAdamW step, 10.8M parameters"
        return f"training step, `{metric.split('/')[1]}` preset, 1 process"

    rows = [[name(metric),
             fmt_range(r["before"], "{:.1f}"), fmt_range(r["after"], "{:.1f}"), fmt_range(r["ratio"], "{:.2f}")]
            for metric, r in doc["results"].items()]
    return _table(["measured (float32, CPU)", f"before ({doc['before']}) ms", "after ms", "after / before"],
                  "<>>>", rows)


def experts(docs: list[dict]) -> list[str]:
    rows = []
    for world, by_ep in docs[0]["results"].items():
        for ep, figures in by_ep.items():
            rows.append([world, ep, _ms(figures["step_ms"]), _ratio(figures["time_ratio"], ep == "1"),
                         _percent(figures["all_to_all_share"]), _mib(figures["anon_bytes"])])
    return _table(["ranks", "ep", "step ms", "vs ep 1", "all-to-all share of the step", "anonymous memory added"],
                  ">>>>>>", rows)


def param_server(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = [[delay, setup, f"{figures['tokens_per_s'][0]:,.0f}", _ratio(figures["vs_data_parallel"],
                                                                      setup == "data parallel"),
             fmt_range(figures["val_loss"], "{:.4f}")]
            for delay, by_setup in doc["results"].items() for setup, figures in by_setup.items()]
    return [f"Two workers ({doc['model']['model.preset']} preset, d_model {doc['model']['model.d_model']}), "
            f"{doc['steps']} steps, a {doc['slow_s']:g} s sleep per delayed step; parameter servers add one server "
            f"rank. Median [min-max] of {doc['repeats']} repeats.", "",
            *_table(["delays", "setup", "tokens/s", "vs data parallel", "held-out loss after the same tokens"],
                    "<<>>>", rows)]


def data_prefetch(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = [[loop, mode, fmt_range(e["data_ms"], "{:.2f}"), fmt_range(e["step_ms"], "{:.1f}"),
             _percent(e["data_share"], digits=1), _ratio(e["time_ratio"], mode == "prefetch 0")]
            for loop, entry in doc["results"].items() for mode, e in entry.items() if isinstance(e, dict)]
    fly = doc["results"]["tokenised on the fly"]
    return [f"One process, one torch thread; medians over {doc['steps']} steps, median [min-max] of "
            f"{doc['repeats']} repeats. Tokenised on the fly: the source alone makes a batch in "
            f"{fly['source_s'][0]:.1f} ms, the step computes in {fly['compute_s'][0]:.1f} ms.", "",
            *_table(["loop", "batches", "wait for data, ms", "step ms", "data share", "vs prefetch 0"],
                    "<<>>>>", rows)]


def prepare_throughput(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = [[f"`{side}`" if side.startswith("prepare") else f"plain `{side.split()[1]}`",
             fmt_range([x / 1e6 for x in e["tokens_per_s"]], "{:.2f}"), fmt_range(e["seconds"], "{:.1f}"),
             _ratio(e["per_worker_vs_plain"], side == "plain encode_batch"),
             _ratio(e["per_worker_vs_fast"], side == "plain encode_batch_fast"),
             _ratio(e["vs_workers_1"]) if "vs_workers_1" in e else "",
             fmt_range(e["startup_s"], "{:.2f}") if "startup_s" in e else ""]
            for side, e in doc["results"].items()]
    return [f"{doc['text_mib']:g} MiB of `.jsonl` ({doc['documents']:,} documents, {doc['tokens'] / 1e6:.1f} M "
            f"tokens of a {doc['vocab_size']:,}-id BPE), batches of {doc['batch_docs']} documents. Each side in a "
            "process of its own, timed from after its imports; `prepare` whole: its workers' start-up, reading, "
            "writing and hashing the shards included (its start-up alone, the same command on one document, in the "
            f"last column). Median [min-max] of {doc['repeats']} repeats, the sides by turns.", "",
            *_table(["side", "M tokens/s", "seconds", "per worker vs plain `encode_batch`",
                     "per worker vs plain `encode_batch_fast`", "vs `--workers 1`", "start-up s"], "<>>>>>>", rows)]


def shard_loader(docs: list[dict]) -> list[str]:
    doc = docs[0]
    res = doc["results"]
    rows = [[place, fmt_range([x / 1e6 for x in e["loader_tokens_per_s"]], "{:.2f}"),
             fmt_range([x / 1e3 for x in e["step_tokens_per_s"]], "{:.1f}"),
             f"{statistics_median(e['loader_tokens_per_s']) / statistics_median(e['step_tokens_per_s']):,.0f}x",
             _ms(e["step_ms"]), _ratio(res["store_over_local_step"], place == "local") if place == "store" else "1.00",
             f"{e['cache_bytes_max'][0] / 2**20:.2f} MiB" if place == "store" else "none (read in place)",
             fmt_range(e["rss_growth_mb"], "{:.1f}") + " MiB"]
            for place, e in ((p, res[p]) for p in ("local", "store"))]
    return [f"The loader alone: one epoch of a {doc['loader_corpus_bytes'] / 2**20:.0f} MiB corpus ({doc['shards']} "
            f"shards) through a {doc['loader_cache_bytes'] / 2**20:.2f} MiB cache (from the store; a local corpus is "
            f"read in place), batches of {doc['ranks']} x {doc['batch_per_rank']} sequences of {doc['seq_len']}. The "
            f"step: `--preset small --nproc {doc['ranks']}` on {doc['step_shard_bytes'] // 1024} KiB shards, fetched all "
            f"through the {doc['steps']} timed steps. Median [min-max] of {doc['repeats']} repeats, local and store by "
            "turns; the S3 server (moto) a process of its own on this machine.", "",
            *_table(["corpus", "loader M tokens/s", "step k tokens/s", "loader / step", "step ms", "step vs local",
                     "cache at most", "resident memory added"], "<>>>>>>>", rows)]


def statistics_median(stats) -> float:
    return stats[0]  # [median, min, max]


def moe_balance(docs: list[dict]) -> list[str]:
    doc = docs[0]
    m = doc["model"]
    rows = [[balance, fmt_range(e["val_loss"], "{:.4f}"), fmt_range(e["train_loss"], "{:.4f}"),
             fmt_range(e["imbalance"], "{:.3f}")] for balance, e in doc["results"].items() if isinstance(e, dict)]
    per_seed = ", ".join(f"{float(v['global']['val_loss']) - float(v['rank']['val_loss']):+.3f}"
                         for v in doc["per_seed"].values())
    return [f"MiniGPT {m['model.n_layer']} layers, d_model {m['model.d_model']}, {m['model.moe_experts']} experts "
            f"top {m['model.moe_top_k']}, on the shipped prose (byte-level), {m['dist.nproc']} ranks x "
            f"{m['train.batch_size']} sequences of {m['model.seq_len']}, {doc['steps']} steps, the same tokens for "
            f"both; median [min-max] over seeds {', '.join(map(str, doc['seeds']))} (held-out loss global - rank "
            f"per seed: {per_seed}). Imbalance: the busiest expert's slots over the mean, per layer and step, "
            "averaged over the last quarter of the steps.", "",
            *_table(["--model.moe_balance", "held-out loss", "training loss (last quarter)", "expert imbalance"],
                    "<>>>", rows)]


def context_parallel_memory(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = []
    for seq, by_cp in doc["memory"].items():
        whole = by_cp["1"]["stored_bytes"]
        rows += [[seq, cp, f"{m['stored_bytes'] / 2**20:.1f} MiB", f"{m['stored_bytes'] / whole:.3f}",
                  f"{m['predicted_bytes'] / 2**20:.1f} MiB", f"{m['peak_bytes'] / 2**20:.1f} MiB"]
                 for cp, m in by_cp.items()]
    return [f"The `{doc['preset']}` preset, one sequence per step ({doc['precision']}, ring attention), rank 0: the "
            "bytes autograd keeps for backward in a step (exact), `minitrain plan`'s prediction, and the most bytes "
            "the CPU allocator held during a step above what it held before (the blocks in transit and the kernels' temporaries included).",
            "", *_table(["sequence", "cp", "stored activations", "vs cp 1", "`minitrain plan`", "allocated peak"],
                        ">>>>>>", rows)]


def context_parallel_time(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = [[f"cp {key.split()[0]}" + (f" {key.split()[1]}" if key != "1 ring" else " (fused kernel)"),
             f"{v['step_ms'][0]:.0f}", fmt_range(v["ratio"], "{:.2f}")] for key, v in doc["timing"].items()]
    return [f"The same model at {doc['time_seq']} tokens, one sequence per step, cp ranks on this machine's cores; "
            f"median of {doc['steps']} steps after {doc['warmup']} warm-up, median [min-max] over {doc['repeats']} "
            "repeats in rotated order.", "", *_table(["layout", "step ms", "vs cp 1"], "<>>", rows)]


def pipeline_schedules(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = []
    for pp, by_schedule in doc["results"].items():
        for schedule, e in by_schedule.items():
            at_costs = fmt_range(e["formula_at_measured_costs"], "{:.3f}") if "formula_at_measured_costs" in e else ""
            per = e["seconds_per_action"]
            costs = " / ".join(f"{k} {1000 * per[k]:.1f}" for k in ("F", "B", "W") if k in per)
            rows.append([pp, schedule, fmt_range(e["bubble"], "{:.3f}"), f"{e['formula']:.3f}", at_costs, costs,
                         f"{e['span_ms'][0]:.0f}", fmt_range(e["vs_1f1b"], "{:.2f}")])
    return [f"The `{doc['preset']}` preset with {doc['layers']} blocks, interleaved over {doc['virtual_stages']} "
            f"chunks per rank, a batch of {doc['batch']} sequences in {doc['microbatches']} micro-batches, "
            f"one rank per stage on this machine's cores, float32; the worst stage's measured bubble, median of "
            f"{doc['steps']} steps after {doc['warmup']} warm-up, median [min-max] over {doc['repeats']} repeats; the "
            "formula with F = B = W and at the F, B and W milliseconds measured (per micro-batch, the first repeat's).",
            "", *_table(["pp", "schedule", "bubble measured", "formula (equal costs)", "formula (measured costs)",
                         "ms per action", "forward + backward ms", "vs 1f1b"], "><>>>>>>", rows)]


def gpu_memory(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = [[str(r["zero"]), r["activation_checkpointing"], f"{r['predicted_bytes'] / 2**30:.2f} GiB",
             f"{r['measured_bytes'] / 2**30:.2f} GiB", f"{100 * r['error']:+.1f}%"] for r in doc["memory"]]
    return [f"{doc['device']}, {doc['preset']} {doc['precision']}, batch {doc['batch']} x "
            "1024 tokens, one process.", "",
            *_table(["ZeRO", "activation checkpointing", "`minitrain plan`", "max_memory_allocated", "plan error"],
                    "><>>>", rows)]


def gpu_timings(docs: list[dict]) -> list[str]:
    doc = docs[0]
    base = {r["zero"]: r["step_s"] for r in doc["timings"] if r["offload"] == "none"}
    rows = [[str(r["zero"]), r["offload"], f"{1000 * r['step_s']:.1f}", f"{r['step_s'] / base[r['zero']]:.2f}",
             f"{r['tokens_per_s']:,.0f}", f"{1000 * r['comm_s']:.2f}", str(r["comm_calls"]),
             "-" if r["overlap"] is None else f"{100 * r['overlap']:.0f}%", f"{1000 * r['busy_s']:.1f}",
             f"{100 * r['timed_share']:.0f}%"] for r in doc["timings"]]
    return [f"{doc['device']}, NCCL {doc['nccl']}, {doc['preset']} {doc['precision']}, batch {doc['batch']}; "
            "medians of 5 steps.", "",
            *_table(["ZeRO", "offload", "step ms", "vs none", "tokens/s", "comm ms", "collectives",
                     "sync overlap", "busy ms", "phases timed"], "><>>>>>>>>", rows)]


def gpu_against_plain(docs: list[dict]) -> list[str]:
    vs = docs[0]["against_plain"]
    sides = {"ours": "ours (statistics read late)", "ours_read_at_once": "ours (statistics read at once)",
             "plain": "plain"}
    rows = [[label, f"{1000 * vs[side]['wall_s']:.1f}", f"{1000 * vs[side]['busy_s']:.1f}",
             f"{1000 * (vs[side]['wall_s'] - vs[side]['busy_s']):.1f}",
             ", ".join(f"{name.removeprefix('minitrain.')} {1000 * s:.2f}" for name, s in
                       list(vs[side]["idle_by_phase"].items())[:3])]
            for side, label in sides.items()]
    kernels = [[f"`{k['name'].replace('|', '/')}`", f"{k['extra_ms']:+.2f}"] for k in vs["kernels_more"][:8]
               if not k["name"].startswith("minitrain.")]  # the phases' labels are host ranges, not kernels
    return [*_table(["under torch.profiler, batch 16", "wall ms", "device busy ms", "device idle ms",
                     "idle gaps by the host's phase, ms"], "<>>><", rows),
            "", *_table(["kernels ours runs more of", "ms per step"], "<>", kernels)]


def gpu_before_after(docs: list[dict]) -> list[str]:
    """The first GPU run (the CPU's chunk sizes) against the current one, step time per layout."""
    before = next(d for d in docs if "before" in d["path"])
    after = next(d for d in docs if d is not before)
    old = {(r["zero"], r["offload"]): r["step_s"] for r in before["timings"]}
    rows = [[str(r["zero"]), r["offload"], f"{1000 * old[(r['zero'], r['offload'])]:.1f}",
             f"{1000 * r['step_s']:.1f}", f"{r['step_s'] / old[(r['zero'], r['offload'])]:.2f}"]
            for r in after["timings"] if (r["zero"], r["offload"]) in old]
    return [f"{after['device']}, {after['preset']} {after['precision']}, batch {after['batch']}.", "",
            *_table(["ZeRO", "offload", "before ms", "after ms", "after / before"], "><>>>", rows)]


def offload_gpu(docs: list[dict]) -> list[str]:
    """benchmarks/gpu.py's timing rows, for the offloaded step: its time against the same stage without offload (the
    same run), and where it went."""
    doc = docs[0]
    base = {r["zero"]: r["step_s"] for r in doc["timings"] if r["offload"] == "none"}
    rows = [[str(r["zero"]), r["offload"], f"{1000 * r['step_s']:.1f}", f"{r['step_s'] / base[r['zero']]:.2f}",
             f"{1000 * r['phases_s']['backward']:.1f}", f"{1000 * r['phases_s']['optimizer']:.1f}"]
            for r in doc["timings"] if r["zero"] in (0, 2)]
    return [f"{doc['device']}, {doc['preset']} {doc['precision']}, batch {doc['batch']}; medians of 5 steps.", "",
            *_table(["ZeRO", "offload", "step ms", "vs none", "backward ms", "optimizer ms"], "><>>>>", rows)]


def object_store(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = [[op, fmt_range(stats, "{:.0f}")] for op, stats in doc["results"].items()]
    return [f"A `{doc['preset']}` checkpoint ({doc['bytes'] / 1e6:.1f} MB), one process, median [min-max] of "
            f"{doc['repeats']} repeats.", "", *_table(["operation", "MB/s"], "<>", rows)]


def zero3_read_guard(docs: list[dict]) -> list[str]:
    doc = docs[0]
    rows = [[str(r["width"]), f"{r['with_check_ms']:.1f}", f"{r['without_ms']:.1f}", fmt_range(r["ratio"], "{:.2f}")]
            for r in doc["rows"]]
    return [f"A 4-layer Hugging Face GPT-2 through `prepare(zero=3)`, one process, with the check and without it "
            f"alternating; median [min-max] of {doc['repeats']} repeats of {doc['steps']} steps.", "",
            *_table(["width", "with the check ms", "without ms", "ratio"], ">>>>", rows)]


def host_adam_vs_deepspeed(docs: list[dict]) -> list[str]:
    names = {"minitrain": "minitrain, decay a pass of its own (a CPU-only machine)",
             "minitrain, decay folded": "minitrain, decay in the kernel (offloaded from a GPU)",
             "deepspeed": "DeepSpeed's `DeepSpeedCPUAdam`"}
    rows = [[r["preset"], str(r["threads"]), names[r["optimizer"]], f"{r['step_ms']:.1f}",
             "1.00" if r["vs_deepspeed"] is None else fmt_range(r["vs_deepspeed"], "{:.2f}"), f"{r['ulps']:.0f}"]
            for doc in sorted(docs, key=lambda doc: doc["rows"][0]["threads"]) for r in doc["rows"]]
    doc = docs[0]
    return [f"One AdamW step over a float32 master, m and v on the host ({doc['rows'][0]['params']:,} parameters); "
            f"median of {doc['steps']} steps, ratio to DeepSpeed's median [min-max] of {doc['repeats']} repeats; "
            "ulps: after 3 steps, the largest distance from torch.optim.AdamW in float64, in units in the last "
            "place of the float32 result.", "",
            *_table(["preset", "threads", "optimizer", "step ms", "vs DeepSpeed", "ulps"], "<><>>>", rows)]


PORT_PARTS = ("uninterrupted", "resumed")


def _loss_differences(runs: dict, part: str) -> dict[str, float]:
    """Iteration -> how far apart rank 0's loss under DDP and ported is, in one part of the run, in order."""
    ddp, ours = runs["ddp"][part]["train"], runs["minitrain"][part]["train"]
    return {i: abs(ddp[i] - ours[i]) for i in sorted(ddp, key=int)}


def nanogpt_port(docs: list[dict]) -> list[str]:
    """Rank 0's loss at every fifth iteration under DDP and ported, and the largest difference at any iteration."""
    runs = docs[0]["runs"]
    rows = []
    for part in PORT_PARTS:
        ddp, ours = runs["ddp"][part]["train"], runs["minitrain"][part]["train"]
        differences = _loss_differences(runs, part)
        steps = list(differences)
        rows += [[part if i == steps[0] else "", i, f"{ddp[i]:.4f}", f"{ours[i]:.4f}", f"{differences[i]:.1e}"]
                 for i in steps if int(i) % 5 == 0 or i == steps[0]]
        rows.append(["", f"all {len(steps)} ({steps[0]}-{steps[-1]})", "", "",
                     f"largest {max(differences.values()):.1e}"])
    return [f"nanoGPT `{docs[0]['nanogpt']}`; the loss is rank 0's last micro-batch's as nanoGPT prints it, to 4 "
            "decimals (so is the difference).", "",
            *_table(["run", "iteration", "DDP", "minitrain", "difference"], "<>>>>", rows)]


def learner_path(docs: list[dict]) -> list[str]:
    """tools/learner_path.py: per strategy, the minitrain files one traced step runs in, with picotron's files
    for the same strategy (read, not traced) under it where picotron has it."""
    doc, target = docs[0], docs[0]["target"]
    rows = []
    for name, entry in doc["results"].items():
        if "error" in entry:
            rows.append([entry["label"], "minitrain", f"failed: {entry['error'].replace('|', '/')}", "", "", "", "", ""])
        else:
            files = entry["files"].values()
            count, lines = len(files), sum(total for total, _ in files)
            within = "" if name not in target["strategies"] else \
                "yes" if count <= target["files"] and lines <= target["lines"] else "no"
            lesson = [total for path, (total, _) in entry["files"].items() if "/parallel/" in path]
            rows.append([entry["label"], "minitrain", str(count), f"{lines:,}", f"{sum(e for _, e in files):,}",
                         str(len(entry["calls"])), f"{len(lesson)}, {sum(lesson):,}", within])
        theirs = doc["picotron"].get(name)
        if theirs:
            rows.append(["", "picotron (reference)", str(theirs["files"]), f"{theirs['lines']:,}", "",
                         f"~{theirs['calls']}", "", ""])
    ep = doc["model"]["ep"]
    return [(f"One step of a {doc['model']['preset']} MiniGPT (expert parallel: {ep['moe_experts']} experts, top "
             f"{ep['moe_top_k']}) on {doc['world_size']} ranks ({doc['backend']}) after one warm-up step, traced on "
             f"rank 0 by `python tools/learner_path.py` at `{doc['revision']}`; picotron's figures are its files for "
             f"that strategy, read in its repository, not traced. Target for DDP, ZeRO, TP and PP: at most "
             f"{target['files']} files and {target['lines']:,} lines. Of them in parallel/: the strategy's folder, "
             f"core/, state/ and user_loop/; the others are the runtime (comm and its watch) and the public API."), "",
            *_table(["strategy", "code", "files", "lines in them", "lines executed", "cross-file calls",
                     "of them in parallel/ (files, lines)", "within the target"], "<<>>>>><", rows)]


def globs(name: str) -> tuple[str, ...]:
    """The result-file globs of one table (TABLES, below): its one glob, or its tuple of them."""
    pattern = TABLES[name][0]
    return (pattern,) if isinstance(pattern, str) else pattern


# README.md's headline rows, in order: the full table each quotes, and the link to the page that holds it.
HEADLINE = {
    "throughput_gpu": "[On a GPU](docs/gpu.md#throughput-against-the-plain-pytorch-loop)",
    "zero_stages_gpt2": "[ZeRO](docs/zero.md#against-pytorchs-ddp-zeroredundancyoptimizer-and-fsdp2)",
    "prepare_vs_peers": "[Python API](docs/api.md#against-pytorch-on-a-hugging-face-gpt-2)",
    "nanogpt_port": "[Porting](docs/porting.md#from-ddp-nanogpts-trainpy-in-three-lines)",
    "ddp_modes": "[Data parallel](docs/data-parallel.md)",
    "tensor_parallel": "[Tensor parallelism](docs/tensor-parallel.md#checks-and-speed)",
    "multinode": "[Multiple machines](docs/multi-node.md#a-cluster-on-one-machine-to-prove-it-here)",
}


def _commands(docs: list[dict]) -> str:
    """The commands that wrote `docs`, each once; a GPU session's without what it ran (after '  # ')."""
    commands = dict.fromkeys(doc["command"].split("  # ")[0] for doc in docs if "command" in doc)
    return ", ".join(f"`{command}`" for command in commands)


def headline(docs: list[dict]) -> list[str]:
    """README.md's headline results: one row per table in HEADLINE, its figures that table's cells (ratios without
    their range), from the same result files by the same helpers, so the two always agree."""
    of = {name: [doc for doc in docs if any(Path(doc["path"]).match(pattern) for pattern in globs(name))]
          for name in HEADLINE}
    rows = {}

    late = {r["compile"]: r for doc in of["throughput_gpu"] for r in doc["results"] if r.get("late_stats")}
    eager, compiled = late[False], late[True]
    rows["throughput_gpu"] = (
        f"one {of['throughput_gpu'][0]['device']}, {eager['preset']} {eager['precision']}, tokens/s against a "
        "plain PyTorch loop",
        f"{_median(_vs_plain(eager))}x eager, {_median(_vs_plain(compiled))}x compiled ({_mfu(compiled['mfu'])} MFU)")

    zero3 = {world: configs["zero3"] for world, configs in _worlds(of["zero_stages_gpt2"])}
    rows["zero_stages_gpt2"] = (
        f"ZeRO-3 against {_and(dict.fromkeys(PEERS[e['peer']] for e in zero3.values()))}, "
        f"{of['zero_stages_gpt2'][0]['model']['model.preset']}, {_and(zero3)} ranks",
        f"{_and(_median(_ratio(e['time_ratio'])) + 'x' for e in zero3.values())} the step time, "
        f"{_and(_median(_ratio(e['memory_ratio'])) + 'x' for e in zero3.values())} the peak memory")

    doc = of["prepare_vs_peers"][0]
    ours = {stage: doc["results"][stage] for stage in ("zero0", "zero3")}
    rows["prepare_vs_peers"] = (
        f"`prepare` on a Hugging Face GPT-2 against {_and(PEERS[e['peer']] for e in ours.values())}, "
        f"{doc['world']} ranks",
        ", ".join(f"ZeRO-{stage[-1]} {_median(_ratio(e['time_ratio']))}x {PEERS[e['peer']]}'s step"
                  for stage, e in ours.items())
        + f"; {_and(_median(_ratio(e['memory_ratio'])) + 'x' for e in ours.values())} the peak memory")

    runs = of["nanogpt_port"][0]["runs"]
    differences = [d for part in PORT_PARTS for d in _loss_differences(runs, part).values()]
    largest = max(differences)
    rows["nanogpt_port"] = (
        "nanoGPT's `train.py` ported in three lines, against it under DDP",
        f"{'the same loss' if largest == 0 else f'losses at most {largest:.1e} apart'} at all {len(differences)} "
        f"printed iterations, {_and(PORT_PARTS)}")

    entry = of["ddp_modes"][0]["results"]["compute-bound"]
    efficiency = {mode: _median(_percent(entry[mode]["scaling_efficiency_2v1"])) for mode in ("bucketed", "torch")}
    rows["ddp_modes"] = (
        "bucketed data parallel against PyTorch DDP, compute-bound model",
        f"{_median(_ratio(entry['bucketed']['ratio_to_torch']))}x the step, {efficiency['bucketed']} 2-vs-1 scaling "
        f"(PyTorch DDP {efficiency['torch']})")

    tp = sorted(of["tensor_parallel"], key=lambda doc: doc["tp"])
    rows["tensor_parallel"] = (
        f"tensor parallel against DTensor, tp {_and(str(doc['tp']) for doc in tp)}",
        f"{_and(_median(_ratio(doc['minitrain_over_dtensor'])) + 'x' for doc in tp)} the step time")

    doc = of["multinode"][0]
    rows["multinode"] = (
        "2 nodes (network namespaces, made as root), then one killed mid-run",
        "byte-equal to one machine in " + _and(f"{_passed(exact)} jobs ({kind} rendezvous)"
                                               for kind, exact in doc["exactness"].items())
        + "; training again " + _and(f"{_elastic_seconds(trials, 'recovery_s')} s ({name})"
                                     for name, trials in doc["elastic"].items()) + " after the kill")

    return _table(["measured", "result", "full table", "reproduce"], "<<<<",
                  [[*rows[name], link, _commands(of[name])] for name, link in HEADLINE.items()])


# Table name -> (result files, renderer). Benchmarks run at several sizes write one file per size.
TABLES = {
    "prepare_vs_peers": ("prepare_vs_peers.json", prepare_vs_peers),
    "prepare_vs_peers_w4": ("prepare_vs_peers_w4.json", prepare_vs_peers),
    "zero_stages": ("zero_stages.json", zero_stages),
    "zero_stages_gpt2": ("zero_stages_gpt2-124m*.json", zero_stages),
    "ddp_modes": ("ddp_modes.json", ddp_modes),
    "activation_checkpointing": ("activation_checkpointing.json", activation_checkpointing),
    "offload": ("offload.json", offload),
    "experts": ("experts.json", experts),
    "param_server": ("param_server.json", param_server),
    "data_prefetch": ("data_prefetch.json", data_prefetch),
    "prepare_throughput": ("prepare_throughput.json", prepare_throughput),
    "shard_loader": ("shard_loader.json", shard_loader),
    "moe_balance": ("moe_balance.json", moe_balance),
    "context_parallel_memory": ("context_parallel.json", context_parallel_memory),
    "pipeline_schedules": ("pipeline_schedules.json", pipeline_schedules),
    "context_parallel_time": ("context_parallel.json", context_parallel_time),
    "tensor_parallel": ("tensor_parallel_tp*.json", tensor_parallel),
    "tensor_parallel_llama": ("tensor_parallel_llama_tp*.json", tensor_parallel),
    "pipeline": ("pipeline_pp*_m*.json", pipeline),
    "pipeline_interleaved": ("pipeline_interleaved_pp*_m*_v*.json", pipeline),
    "comm": ("comm_n*.json", comm),
    "precision_memory": ("precision_memory.json", precision_memory),
    "torchrun_restarts": ("torchrun_restarts_*.json", torchrun_restarts),
    "throughput": ("throughput.json", throughput),
    "throughput_gpu": ("throughput_gpu*.json", throughput),
    "throughput_alternating": ("throughput_alternating_r*.json", throughput_alternating),  # two trees by turns
    "throughput_alternating_gpu": ("throughput_alternating_gpu_r*.json", throughput_alternating),
    "step_costs": ("step_costs.json", step_costs),
    "gpu_throughput_before": ("gpu_throughput_*.json", throughput),  # an earlier commit, the same session
    "gpu_memory": ("gpu.json", gpu_memory),
    "gpu_timings": ("gpu.json", gpu_timings),
    "gpu_against_plain": ("gpu.json", gpu_against_plain),
    "gpu_before_after": ("gpu_[bh]*.json", gpu_before_after),  # both on the H200
    "object_store": ("object_store.json", object_store),
    "offload_gpu": ("offload_gpu.json", offload_gpu),
    "multinode": ("multinode.json", multinode),
    "before_after": ("before_after.json", before_after),
    "zero3_read_guard": ("zero3_read_guard.json", zero3_read_guard),
    "host_adam_vs_deepspeed": ("host_adam_vs_deepspeed_t*.json", host_adam_vs_deepspeed),
    "nanogpt_port": ("nanogpt_port.json", nanogpt_port),
    "chaos_campaigns": ("chaos_seed*.json", chaos_campaigns),
    "chaos_faults": ("chaos_seed*.json", chaos_faults),
    "learner_path": ("learner_path.json", learner_path),
}
# A table of figures quoted from others reads their result files: a tuple of globs, each table's in turn.
TABLES["headline"] = (tuple(pattern for name in HEADLINE for pattern in globs(name)), headline)


def load(name: str) -> list[dict]:
    """The result files of one table, glob by glob, each with its path from the repository root as "path"."""
    docs = []
    for pattern in globs(name):
        paths = sorted(RESULTS.glob(pattern))
        if not paths:
            raise FileNotFoundError(f"no result file {RESULTS.relative_to(ROOT) / pattern}")
        docs += [{**json.loads(path.read_text()), "path": path.relative_to(ROOT).as_posix()} for path in paths]
    return docs


def render(name: str, indent: str = "") -> str:
    """What belongs between table NAME's markers (each non-empty line indented by `indent`)."""
    docs = load(name)
    return "".join(f"{indent}{line}\n" if line else "\n"
                   for line in [*TABLES[name][1](docs), "", source_line(docs)])


def markdown_files() -> list[Path]:
    """The files tables may live in: README.md, then docs/*.md in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def generate(text: str) -> str:
    """`text` (one markdown file) with every known table in it rendered afresh."""
    def fresh(m: re.Match) -> str:
        indent, name = m.group(1), m.group(2)
        if name not in TABLES:
            return m.group(0)
        return f"{indent}<!-- table: {name} -->\n{render(name, indent)}{indent}<!-- /table -->"

    return BLOCK.sub(fresh, text)


def stale(text: str, file: str = "README.md") -> list[str]:
    """One line per problem with the tables of `text`, the markdown file named `file`: an unknown table
    name, or a known table that the result files would render differently."""
    problems = []
    for m in BLOCK.finditer(text):
        indent, name, body = m.groups()
        if name not in TABLES:
            problems.append(f"{file}: unknown table {name!r} (known: {', '.join(TABLES)})")
        elif body != render(name, indent):
            sources = ", ".join(str(RESULTS.relative_to(ROOT) / pattern) for pattern in globs(name))
            problems.append(f"{file}: table {name} differs from {sources}; run python benchmarks/tables.py")
    return problems


def placement(texts: dict[str, str]) -> list[str]:
    """One line per known table that is in none of `texts` (file name -> text), or in more than one place."""
    where: dict[str, list[str]] = {name: [] for name in TABLES}
    for file, text in texts.items():
        for m in BLOCK.finditer(text):
            where.setdefault(m.group(2), []).append(file)
    problems = []
    for name in TABLES:
        if not where[name]:
            problems.append(f"no <!-- table: {name} --> block in {', '.join(texts)}")
        elif len(where[name]) > 1:
            problems.append(f"table {name} appears {len(where[name])} times, once is right: {', '.join(where[name])}")
    return problems


def check(texts: dict[str, str]) -> list[str]:
    """Every problem with the tables of `texts` (file name -> text): each file's stale or unknown
    tables, then known tables missing or repeated across the files."""
    return [line for file, text in texts.items() for line in stale(text, file)] + placement(texts)


def read_all() -> dict[str, str]:
    """README.md and docs/*.md, by their path from the repository root."""
    return {_name(path): path.read_text() for path in markdown_files()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    texts = read_all()
    if args.check:
        problems = check(texts)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    for path in markdown_files():
        text = texts[_name(path)]
        count = len(BLOCK.findall(text))
        if not count:
            continue
        new = generate(text)
        if new != text:
            path.write_text(new)
        print(f"{'rewrote' if new != text else 'unchanged:'} {_name(path)} ({count} generated tables)")
    problems = check(read_all())  # what rewriting cannot fix: unknown names, missing or repeated tables
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
