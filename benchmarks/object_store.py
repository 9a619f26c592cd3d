"""Checkpoint throughput to an S3-compatible server against a local directory, one process, one preset.

The server is moto's (in a thread of this process, on loopback: what it measures is minitrain's and the S3
client's work per byte, not a network's). For each repeat a trainer of --preset saves one checkpoint:
- local save: `checkpoint.save` into a fresh directory (shards written, fsynced, manifest, rename);
- upload: that step directory to the server (`remote.upload_collectively`: every file, then the commit object);
- local verify: every file read back and its sha256 checked (what a resume reads first);
- fetch: the committed checkpoint downloaded from the server and verified (`remote.fetch`).
Figures are MB/s of the checkpoint's bytes (1 MB = 10^6 bytes), median [min-max] over repeats.

    .venv/bin/python benchmarks/object_store.py [--preset small] [--repeats 3] [--out FILE]

Writes benchmarks/results/object_store.json (or --out).
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

from ranges import fmt_range, median_range  # benchmarks/ranges.py
from record import RESULTS, write_result  # benchmarks/record.py

from minitrain import checkpoint
from minitrain.checkpoint import remote
from minitrain.runtime.launch import free_port
from minitrain.runtime.topology import Topology
from minitrain.train.metrics import format_table
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

OPERATIONS = ("local save", "upload", "local verify", "fetch")


def start_server() -> object:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    return server


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def one_repeat(trainer: Trainer, url: str, scratch: Path) -> tuple[int, dict[str, float]]:
    topo = trainer.topo
    local = scratch / "local"
    seconds = {"local save": timed(lambda: trainer.save_checkpoint(local))}
    step_dir = checkpoint.resolve(local)
    size = sum(f.stat().st_size for f in step_dir.iterdir())
    seconds["upload"] = timed(lambda: remote.upload_collectively(step_dir, url, topo))
    seconds["local verify"] = timed(lambda: checkpoint.verify(step_dir))
    seconds["fetch"] = timed(lambda: remote.fetch(url, trainer.step, scratch / "fetched"))
    return size, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "object_store.json"))
    args = parser.parse_args(argv)
    server = start_server()
    try:
        fs, _ = remote.store("s3://bench")
        fs.mkdir("bench")
        trainer = Trainer(run_config(cli_values={"model.preset": args.preset, "train.log_every": 0}),
                          Topology.single())
        trainer.train_step()
        rates: dict[str, list[float]] = {op: [] for op in OPERATIONS}
        for repeat in range(args.repeats):
            with tempfile.TemporaryDirectory() as scratch:
                size, seconds = one_repeat(trainer, f"s3://bench/repeat-{repeat}", Path(scratch))
            for op in OPERATIONS:
                rates[op].append(size / seconds[op] / 1e6)
    finally:
        server.stop()
    results = {op: median_range(values) for op, values in rates.items()}
    body = {"preset": args.preset, "bytes": size, "repeats": args.repeats, "format": "MB/s: median, min, max",
            "results": results}
    path = write_result(args.out, __file__, argv, body)
    print(format_table(["operation", "MB/s"], [[op, fmt_range(results[op], "{:.0f}")] for op in OPERATIONS]))
    print(f"checkpoint of {args.preset}: {size / 1e6:.1f} MB; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
