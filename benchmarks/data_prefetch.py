"""Data off the critical path: the step's wait for its batch, made on the spot against made ahead (utils/prefetch.py).

Two loops, each timed with batches made in the step (prefetch 0) and by the prefetch thread (2 ahead), in
alternating order per repeat, one process, one torch thread:

- **prepared corpus**: `minitrain train`'s step (the Trainer, small preset) on a corpus written by `minitrain
  data prepare` (memory-mapped token shards, through TokenShards). The step profiler's `data` phase, per step.
- **tokenised on the fly**: a user's loop through the API (`minitrain.prepare`, torch.optim.AdamW) whose batches
  come from raw text as it trains: each example a document drawn at random, tokenised whole (the `tokenizers`
  BPE `minitrain data prepare` trains, fitted here on the shipped text) and a random window cut from it, so
  tokenising a batch takes about as long as its step on this small model (as a CPU tokenizer does against a
  GPU's step). The time spent waiting in next(batches), per step. The source alone is timed too: made
  ahead, a step takes no less than the longer of it and the step's compute (the step made on the spot less its
  wait).

Both sides take the same batches (checked: their checksums are equal). Ratios are to prefetch 0 in the same
repeat; figures are median [min-max] over repeats.

    .venv/bin/python benchmarks/data_prefetch.py [--steps 30] [--repeats 3] [--out FILE]

Writes benchmarks/results/data_prefetch.json (or --out).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

import minitrain
from minitrain.config import ModelConfig
from minitrain.corpus.tokenizer import encode_batch, train_bpe, vocab_size
from minitrain.models.minigpt import MiniGPT
from minitrain.runtime.topology import Topology
from minitrain.train.metrics import format_table
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

TRAINER = {"model.preset": "small", "train.batch_size": 4, "train.log_every": 0}
USER_MODEL = dict(n_layer=1, d_model=32, n_head=2, seq_len=128)
USER_BATCH, DEPTH, WARMUP = 16, 2, 3
DOC_CHARS = 6000  # a document is tokenised whole for the one window cut from it


def shipped_text() -> str:
    return resources.files("minitrain").joinpath("corpora", "field_notes.txt").read_text(encoding="utf-8")


# --- prepared corpus: the trainer's data phase --------------------------------------------------------------
def prepared_corpus(directory: Path) -> Path:
    """The shipped text through `minitrain data prepare`, as a user prepares theirs."""
    text = directory / "notes.txt"
    text.write_text(shipped_text() * 8, encoding="utf-8")
    out = directory / "notes"
    subprocess.run([sys.executable, "-m", "minitrain", "data", "prepare", str(text), "--vocab-size", "512",
                    "--out", str(out)], check=True, capture_output=True)
    return out


def trainer_steps(corpus: Path, prefetch: int, steps: int) -> dict:
    cfg = run_config(cli_values={**TRAINER, "data.corpus": str(corpus), "data.prefetch": prefetch,
                                 "train.steps": WARMUP + steps})
    with Trainer(cfg, Topology.single()) as trainer:
        for _ in range(WARMUP):
            trainer.train_step()
        records = [trainer.train_step() for _ in range(steps)]
    return {"data_s": statistics.median(r.phases_s["data"] for r in records),
            "step_s": statistics.median(r.step_time_s for r in records),
            "losses": [r.loss for r in records]}


# --- tokenised on the fly: a user's loop ---------------------------------------------------------------------
def documents(text: str, chars: int = DOC_CHARS) -> list[str]:
    """The text cut at line ends into documents of about `chars` characters."""
    docs, current = [], ""
    for line in text.splitlines(keepends=True):
        current += line
        if len(current) >= chars:
            docs.append(current)
            current = ""
    return docs


def tokenised_batches(tok, docs: list[str], seed: int):
    """(inputs, targets): USER_BATCH documents drawn at random, each tokenised whole as it is needed and a
    window of seq_len + 1 tokens cut from it at random: a user's on-the-fly pipeline over long documents."""
    rng, width = np.random.default_rng(seed), USER_MODEL["seq_len"] + 1
    while True:
        rows = []
        for ids in encode_batch(tok, [docs[i] for i in rng.integers(0, len(docs), size=USER_BATCH)]):
            start = int(rng.integers(0, len(ids) - width + 1))
            rows.append(ids[start:start + width])
        window = torch.tensor(rows, dtype=torch.int64)
        yield window[:, :-1], window[:, 1:]


def user_loop(tok, docs: list[str], prefetch: int, steps: int) -> dict:
    """The user's loop on batches made in the step or by a Prefetcher; the seconds waited for each batch."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab_size(tok), **USER_MODEL)
    model, optimizer = minitrain.prepare(MiniGPT(config), functools.partial(torch.optim.AdamW, lr=1e-3))
    source = tokenised_batches(tok, docs, seed=1)
    batches = minitrain.Prefetcher(source, depth=prefetch) if prefetch else source
    waits, times, checksum = [], [], 0
    for i in range(WARMUP + steps):
        start = time.perf_counter()
        x, y = next(batches)
        got = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= WARMUP:
            waits.append(got - start)
            times.append(time.perf_counter() - start)
            checksum += int(x.sum())
    if prefetch:
        batches.close()
    return {"data_s": statistics.median(waits), "step_s": statistics.median(times), "checksum": checksum}


def source_alone(tok, docs: list[str], steps: int) -> float:
    """Seconds a batch of the source takes, made back to back with nothing else running."""
    source = tokenised_batches(tok, docs, seed=1)
    for _ in range(WARMUP):
        next(source)
    start = time.perf_counter()
    for _ in range(steps):
        next(source)
    return (time.perf_counter() - start) / steps


def summarise(runs: list[dict], extra: tuple[str, ...] = ()) -> dict:
    """Per mode: data ms, step ms, data share of the step, step time against prefetch 0 (median [min-max])."""
    out = {}
    for mode in ("prefetch 0", f"prefetch {DEPTH}"):
        out[mode] = {"data_ms": median_range([1000 * r[mode]["data_s"] for r in runs]),
                     "step_ms": median_range([1000 * r[mode]["step_s"] for r in runs]),
                     "data_share": median_range([r[mode]["data_s"] / r[mode]["step_s"] for r in runs]),
                     "time_ratio": median_range([r[mode]["step_s"] / r["prefetch 0"]["step_s"] for r in runs])}
    for key in extra:
        out[key] = median_range([1000 * r[key] for r in runs])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "data_prefetch.json"), help="the result file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the tokenizer on one thread: the prefetch thread's
    modes = {"prefetch 0": 0, f"prefetch {DEPTH}": DEPTH}
    text = shipped_text()
    tok = train_bpe([text], 2048)
    docs = documents(text)
    prepared, on_the_fly = [], []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = prepared_corpus(Path(tmp))
        for r in range(args.repeats):
            order = list(modes.items()) if r % 2 == 0 else list(modes.items())[::-1]
            prepared.append({mode: trainer_steps(corpus, depth, args.steps) for mode, depth in order})
            on_the_fly.append({mode: user_loop(tok, docs, depth, args.steps) for mode, depth in order})
            plain = on_the_fly[-1]["prefetch 0"]
            on_the_fly[-1].update(source_s=source_alone(tok, docs, args.steps),
                                  compute_s=plain["step_s"] - plain["data_s"])  # the step less its wait for data
            if prepared[-1]["prefetch 0"]["losses"] != prepared[-1][f"prefetch {DEPTH}"]["losses"]:
                raise SystemExit("prepared corpus: the losses differ with and without prefetch")
            if on_the_fly[-1]["prefetch 0"]["checksum"] != on_the_fly[-1][f"prefetch {DEPTH}"]["checksum"]:
                raise SystemExit("tokenised on the fly: the batches differ with and without prefetch")
            print(f"repeat {r + 1}: " + ", ".join(
                f"{name} {mode} data {1000 * runs[-1][mode]['data_s']:.2f} ms of {1000 * runs[-1][mode]['step_s']:.1f}"
                for name, runs in (("prepared", prepared), ("on the fly", on_the_fly)) for mode in modes),
                file=sys.stderr, flush=True)
    report = {"prepared corpus": summarise(prepared),
              "tokenised on the fly": summarise(on_the_fly, ("source_s", "compute_s"))}
    rows = []
    for loop_name, entry in report.items():
        for mode in modes:
            e = entry[mode]
            rows.append([loop_name, mode, fmt_range(e["data_ms"], "{:.2f}"), fmt_range(e["step_ms"], "{:.1f}"),
                         fmt_range([100 * x for x in e["data_share"]], "{:.1f}"), fmt_range(e["time_ratio"], "{:.2f}")])
    write_result(args.out, __file__, argv,
                 {"trainer": TRAINER, "user_model": USER_MODEL, "user_batch": USER_BATCH, "depth": DEPTH,
                  "steps": args.steps, "warmup": WARMUP, "repeats": args.repeats,
                  "format": "each figure is [median, min, max] over repeats; ms are medians over steps",
                  "results": report})
    print(format_table(["loop", "batches", "data ms", "step ms", "data %", "vs prefetch 0"], rows, "<<>>>>"))
    fly = report["tokenised on the fly"]
    print(f"tokenised on the fly: the source alone {fly['source_s'][0]:.1f} ms a batch, the step's compute "
          f"{fly['compute_s'][0]:.1f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
