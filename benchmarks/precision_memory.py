"""Model state at rest per rank, fp32 against bf16, at every ZeRO stage: the bytes the tensors' storages
hold after a step, next to the memory rule they must equal.

`small` preset (3.32M parameters), 2 ranks, one training step each (so ZeRO-2's gradient shard and
every optimizer state exist), bf16 reducing in float32 (the default). Bytes are exact, not timed: the
figures depend on the model and the rule, not on the machine.

    .venv/bin/python benchmarks/precision_memory.py [--nproc 2] [--out FILE]

Writes benchmarks/results/precision_memory.json (or --out: command, machine, every figure).
"""
from __future__ import annotations

import argparse
import json

from record import RESULTS, write_result  # benchmarks/record.py


from minitrain.train.run_config import run_config
from minitrain.runtime.launch import launch
from minitrain.train.trainer import Trainer

PRECISIONS = ("fp32", "bf16")


def worker(topo) -> dict:
    out = {}
    for precision in PRECISIONS:
        for zero in range(4):
            cfg = run_config(cli_values={"model.preset": "small", "train.zero": zero, "train.precision": precision,
                                           "dist.nproc": topo.world_size, "train.log_every": 0,
                                           "data.synthetic_tokens": 1 << 16})
            trainer = Trainer(cfg, topo)
            trainer.train_step()
            s = trainer.strategy
            out[f"{precision}/zero{zero}"] = {"bytes": s.memory_bytes(), "expected": s.expected_memory_bytes(),
                                              "formula": s.memory_formula(), "params": s.flat.numel}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "precision_memory.json"))
    args = parser.parse_args(argv)
    results = launch(worker, args.nproc, backend="gloo")[0]
    for name, r in results.items():
        if r["bytes"] != r["expected"]:
            raise SystemExit(f"{name}: measured {r['bytes']} differs from the memory rule {r['expected']}")
    path = write_result(args.out, __file__, argv, {"world_size": args.nproc, "preset": "small", "results": results})
    print(json.dumps({k: sum(v["bytes"].values()) for k, v in results.items()}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
