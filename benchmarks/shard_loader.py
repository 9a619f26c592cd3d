"""Training data from shards: is the loader ever the bottleneck, from local disk or from an object store?

Two corpora of random token shards (the small preset's vocabulary) are each written twice: into a local
directory and into an S3 server (moto's, a process of its own on a free port, as a bucket on the network would
be). Measured, alternating local and store within each repeat:

- **the loader alone**, on a corpus of 180 shards of 256 KiB (45 MiB) and a cache of a twentieth of it (the
  default for these shards: two blocks of 4 and one spare): `minitrain.TokenShards` taking batches back to back
  on one rank (batch and sequence of the step below, both ranks' share) through one whole epoch, in tokens/s;
  the highest bytes in the cache and the process's peak resident memory added while reading (VmHWM, reset
  before): the corpus streams through a cache a twentieth its size.
- **the step**, on a corpus of 16 KiB shards, small beside a step's consumption, so the run fetches blocks of
  shards all through the timed steps: `minitrain train --preset small --nproc 2` for the same steps on the local
  corpus and on the store's, the median step time (metrics.jsonl, after warm-up), its tokens/s (what the loader
  must keep up with) and the ratio store / local.

    .venv/bin/python benchmarks/shard_loader.py [--steps 40] [--repeats 3] [--out FILE]

Writes benchmarks/results/shard_loader.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from ranges import median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

from minitrain.corpus.shard_index import Shard, ShardIndex, sha256_of, shard_name
from minitrain.corpus.tokenizer import byte_level_tokenizer
from minitrain.runtime.launch import free_port

VOCAB, SEQ, BATCH, RANKS, WARMUP = 256, 128, 8, 2, 5  # the small preset's vocabulary and sequence; batch per rank
SHARDS, CACHE_SHARDS = 180, 9  # the default cache holds 9 shards (two blocks of 4, one spare): a twentieth
LOADER_SHARD_TOKENS, STEP_SHARD_TOKENS = 131072, 8192  # 256 KiB and 16 KiB


def write_corpus(put, shard_tokens: int, seed: int = 0) -> None:
    """Random shards, the tokenizer and index.json through put(name, bytes)."""
    rng, shards = np.random.default_rng(seed), []
    for split, count in (("train", SHARDS), ("val", 1)):
        for n in range(count):
            data = rng.integers(0, VOCAB, shard_tokens).astype("<u2").tobytes()
            put(shard_name(split, n), data)
            shards.append(Shard(shard_name(split, n), split, shard_tokens, sha256_of(data)))
    meta = {"vocab_size": VOCAB, "dtype": "uint16", "eot_id": None, "tokenizer": "tokenizer.json",
            "val_fraction": 1 / (SHARDS + 1), "shard_bytes": 2 * shard_tokens, "documents": 1,
            "sources": [{"path": "random", "bytes": 0, "documents": 1}]}
    put("tokenizer.json", byte_level_tokenizer().to_str().encode())
    put("index.json", ShardIndex("", meta, tuple(shards)).to_json().encode())


class S3Server:
    """moto's S3 server in a process of its own, with a bucket; the AWS variables point this process and its
    children at it."""

    def __init__(self, bucket: str):
        self.port = free_port()
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://127.0.0.1:{self.port}")
        from minitrain.utils.object_store import remote_store

        self.fs, _ = remote_store(f"s3://{bucket}")
        for _ in range(100):  # until it answers
            try:
                self.fs.mkdir(bucket)
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def _memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def loader_alone(corpus: str, cache: Path) -> dict:
    """tokens/s of TokenShards taking one epoch's batches back to back; the cache's highest bytes; the peak
    resident memory added over the run."""
    import minitrain

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    base_kb = _memory_kb("VmRSS")
    loader = minitrain.TokenShards(corpus, SEQ, BATCH * RANKS, seed=1, cache_dir=cache)
    batches = loader.num_examples // (BATCH * RANKS) - WARMUP
    for _ in range(WARMUP):
        loader.next_batch()
    most, start = 0, time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
        most = max(most, loader.cached_bytes())
    seconds = time.perf_counter() - start
    loader.close()
    return {"tokens_per_s": batches * BATCH * RANKS * SEQ / seconds, "cache_bytes_max": most,
            "rss_growth_mb": (_memory_kb("VmHWM") - base_kb) / 1024}


def train_steps(corpus: str, out: Path, steps: int) -> dict:
    """`minitrain train --preset small --nproc 2`: the median step time and tokens/s after warm-up."""
    cmd = [sys.executable, "-m", "minitrain", "train", "--preset", "small", "--nproc", str(RANKS), "--corpus", corpus,
           "--batch-size", str(BATCH), "--steps", str(WARMUP + steps), "--train.log_every", "0", "--out", str(out),
           "--ckpt.every_steps", "0"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r][WARMUP:]
    return {"step_s": statistics.median(r["step_time_s"] for r in rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "shard_loader.json"), help="the result file")
    args = parser.parse_args(argv)
    server = S3Server("bench")
    runs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            for name, tokens in (("loader", LOADER_SHARD_TOKENS), ("step", STEP_SHARD_TOKENS)):
                (tmp / name).mkdir()
                write_corpus(lambda shard, data, name=name: (tmp / name / shard).write_bytes(data), tokens)
                write_corpus(lambda shard, data, name=name: server.fs.pipe_file(f"bench/{name}/{shard}", data), tokens)
            places = {"local": str(tmp), "store": "s3://bench"}
            for r in range(args.repeats):
                run = {}
                for place in (list(places) if r % 2 == 0 else list(places)[::-1]):
                    run[place] = {"loader": loader_alone(f"{places[place]}/loader", tmp / f"cache-{r}-{place}"),
                                  "step": train_steps(f"{places[place]}/step", tmp / f"run-{r}-{place}", args.steps)}
                runs.append(run)
                print(f"repeat {r + 1}: " + ", ".join(
                    f"{p} loader {run[p]['loader']['tokens_per_s']:,.0f} tok/s, step {1000 * run[p]['step']['step_s']:.1f} ms"
                    for p in places), file=sys.stderr, flush=True)
    finally:
        server.close()
    report = {place: {"loader_tokens_per_s": median_range([r[place]["loader"]["tokens_per_s"] for r in runs]),
                      "step_ms": median_range([1000 * r[place]["step"]["step_s"] for r in runs]),
                      "step_tokens_per_s": median_range([r[place]["step"]["tokens_per_s"] for r in runs]),
                      "cache_bytes_max": median_range([r[place]["loader"]["cache_bytes_max"] for r in runs]),
                      "rss_growth_mb": median_range([r[place]["loader"]["rss_growth_mb"] for r in runs])}
              for place in ("local", "store")}
    report["store_over_local_step"] = median_range([r["store"]["step"]["step_s"] / r["local"]["step"]["step_s"]
                                                    for r in runs])
    write_result(args.out, __file__, argv,
                 {"shards": SHARDS, "loader_corpus_bytes": SHARDS * LOADER_SHARD_TOKENS * 2,
                  "loader_cache_bytes": CACHE_SHARDS * LOADER_SHARD_TOKENS * 2,
                  "step_shard_bytes": STEP_SHARD_TOKENS * 2, "seq_len": SEQ, "batch_per_rank": BATCH,
                  "ranks": RANKS, "steps": args.steps, "warmup": WARMUP, "repeats": args.repeats,
                  "format": "each figure is [median, min, max] over repeats", "results": report})
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
