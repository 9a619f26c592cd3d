"""`minitrain data prepare` against a plain loop over Hugging Face `tokenizers`' encode_batch: tokens per second.

The text: documents of one to six paragraphs of the shipped corpus (src/minitrain/corpora/field_notes.txt) drawn by
a seed, --mb MiB of them, one JSON object a line. The tokenizer: a byte-level BPE of --vocab-size trained on the
shipped text, saved once, used by every side. Each side runs in a process of its own, after its imports and
before its timer:

- **plain encode_batch**: read the .jsonl, json.loads each line, encode_batch (add_special_tokens=False) in batches
  of the size prepare sends (encode_pool.BATCH_DOCS documents), take each document's ids: what a user's script does
  at the least. RAYON_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false, so it runs on one core.
- **plain encode_batch_fast**: the same with encode_batch_fast, which skips the character offsets (the same ids),
  as prepare encodes: the library's own speed for what prepare does.
- **prepare --workers W**: `minitrain data prepare FILE --tokenizer TOK --out DIR --workers W`, the whole command
  (checking each line, encoding, writing and hashing the shards, index.json), timed around its main(). Its
  start-up, timed alike on a one-document input, is recorded beside it: with W > 1 mostly the workers' start
  (each a Python that imports minitrain, and so torch, then loads the tokenizer).

Ratios are to the plain loops of the same repeat (per worker: tokens/s / W); the sides run by turns, in an order
that alternates between repeats. Figures are median [min-max] over repeats.

    .venv/bin/python benchmarks/prepare_throughput.py [--mb 48] [--repeats 3] [--out FILE]

Writes benchmarks/results/prepare_throughput.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import numpy as np
from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

SEED, VOCAB = 0, 4096
ONE_THREAD = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def shipped_text() -> str:
    return resources.files("minitrain").joinpath("corpora", "field_notes.txt").read_text(encoding="utf-8")


def make_text(path: Path, mib: float, seed: int) -> int:
    """Documents drawn from the shipped paragraphs into a .jsonl of about `mib` MiB; returns how many."""
    parts = [p for p in shipped_text().split("\n\n") if p.strip()]
    rng = np.random.default_rng(seed)
    size, count = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mib * 2**20:
            doc = "\n\n".join(parts[i] for i in rng.integers(0, len(parts), size=int(rng.integers(1, 7))))
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
            count += 1
    return count


def plain_loop(text: str, tokenizer: str, method: str) -> dict:
    """The child side of a plain loop: seconds and tokens of `method` (encode_batch or encode_batch_fast) over the
    file's documents."""
    from tokenizers import Tokenizer

    from minitrain.corpus.encode_pool import BATCH_DOCS

    encode = getattr(Tokenizer.from_file(tokenizer), method)
    start = time.perf_counter()
    tokens, batch = 0, []
    with open(text, encoding="utf-8") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == BATCH_DOCS:
                tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
                batch = []
    if batch:
        tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def prepare_command(text: str, tokenizer: str, out: str, workers: int) -> dict:
    """The child side of `prepare`: seconds of the command, and the tokens its index lists."""
    from minitrain.apps.cli import main

    start = time.perf_counter()
    code = main(["data", "prepare", text, "--tokenizer", tokenizer, "--out", out, "--workers", str(workers)])
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"prepare exited {code}")
    index = json.loads((Path(out) / "index.json").read_text())
    return {"seconds": seconds, "tokens": sum(s["tokens"] for s in index["shards"]), "documents": index["documents"]}


def child(argv: list[str]) -> dict:
    """One side, in a process of its own: the plain loop's on one thread from its start (prepare sets its own)."""
    env = {**os.environ, **ONE_THREAD} if argv[0] == "plain" else dict(os.environ)
    result = subprocess.run([sys.executable, __file__, "--child", json.dumps(argv)], capture_output=True, text=True,
                            check=False, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{argv[0]} failed: {result.stderr.strip()}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=48, help="MiB of text (default 48)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "prepare_throughput.json"), help="the result file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        side, *rest = json.loads(args.child)
        print(json.dumps(plain_loop(*rest) if side == "plain" else prepare_command(*rest)))
        return 0

    import tokenizers

    from minitrain.corpus.encode_pool import BATCH_DOCS
    from minitrain.corpus.tokenizer import train_bpe
    from minitrain.train.metrics import format_table

    sides = {"plain encode_batch": 1, "plain encode_batch_fast": 1, "prepare --workers 1": 1, "prepare --workers 2": 2}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        text, tokenizer = str(Path(tmp) / "docs.jsonl"), str(Path(tmp) / "tokenizer.json")
        documents = make_text(Path(text), args.mb, SEED)
        tiny = Path(tmp) / "tiny.jsonl"
        tiny.write_text(json.dumps({"text": shipped_text()[:2000]}) + "\n", encoding="utf-8")
        train_bpe([shipped_text()], VOCAB).save(tokenizer)
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            run = {}
            for side in order:
                if side.startswith("plain"):
                    run[side] = child(["plain", text, tokenizer, side.split()[1]])
                else:
                    out = str(Path(tmp) / "out")
                    run[side] = child(["prepare", text, tokenizer, out, sides[side]])
                    shutil.rmtree(out)
                    run[side]["startup_s"] = child(["prepare", str(tiny), tokenizer, out, sides[side]])["seconds"]
                    shutil.rmtree(out)
            plain, fast = run["plain encode_batch"], run["plain encode_batch_fast"]
            for side, workers in sides.items():  # the same ids, each document's end-of-text id besides
                expected = plain["tokens"] + (documents if side.startswith("prepare") else 0)
                if run[side]["tokens"] != expected:
                    raise SystemExit(f"{side} wrote {run[side]['tokens']} tokens, expected {expected}")
                run[side]["tokens_per_s"] = plain["tokens"] / run[side]["seconds"]  # the text's tokens, no EOT
            for side, workers in sides.items():
                run[side]["per_worker_vs_plain"] = run[side]["tokens_per_s"] / workers / plain["tokens_per_s"]
                run[side]["per_worker_vs_fast"] = run[side]["tokens_per_s"] / workers / fast["tokens_per_s"]
            runs.append(run)
            print(f"repeat {r + 1}: " + ", ".join(f"{side} {run[side]['tokens_per_s']:,.0f} tok/s"
                                                  for side in sides), file=sys.stderr, flush=True)
    results = {}
    for side in sides:
        results[side] = {"tokens_per_s": median_range([run[side]["tokens_per_s"] for run in runs]),
                         "seconds": median_range([run[side]["seconds"] for run in runs]),
                         "per_worker_vs_plain": median_range([run[side]["per_worker_vs_plain"] for run in runs]),
                         "per_worker_vs_fast": median_range([run[side]["per_worker_vs_fast"] for run in runs])}
    for side in sides:
        if side.startswith("prepare"):
            results[side]["startup_s"] = median_range([run[side]["startup_s"] for run in runs])
    results["prepare --workers 2"]["vs_workers_1"] = median_range(
        [run["prepare --workers 2"]["tokens_per_s"] / run["prepare --workers 1"]["tokens_per_s"] for run in runs])
    write_result(args.out, __file__, argv,
                 {"text_mib": args.mb, "documents": documents, "tokens": runs[0]["plain encode_batch"]["tokens"],
                  "vocab_size": VOCAB, "batch_docs": BATCH_DOCS, "seed": SEED, "repeats": args.repeats,
                  "format": "each figure is [median, min, max] over repeats; tokens/s count the text's tokens",
                  "results": results},
                 tokenizers=tokenizers.__version__)
    rows = [[side, fmt_range([x / 1e6 for x in e["tokens_per_s"]], "{:.2f}"), fmt_range(e["seconds"], "{:.1f}"),
             fmt_range(e["per_worker_vs_plain"], "{:.2f}"), fmt_range(e["per_worker_vs_fast"], "{:.2f}"),
             fmt_range(e["vs_workers_1"], "{:.2f}") if "vs_workers_1" in e else "",
             fmt_range(e["startup_s"], "{:.1f}") if "startup_s" in e else ""] for side, e in results.items()]
    print(format_table(["side", "M tokens/s", "seconds", "per worker vs plain", "vs plain fast", "vs --workers 1",
                        "start-up s"], rows, "<>>>>>>"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
