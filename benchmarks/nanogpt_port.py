"""nanoGPT's train.py ported from DDP to minitrain as a user ports it, both run here on 2 ranks, and the loss of
every iteration compared: docs/porting.md's table.

    python benchmarks/nanogpt_port.py --nanogpt PATH [--iters 20] [--out benchmarks/results/nanogpt_port.json]

PATH is a checkout of karpathy/nanoGPT (not part of minitrain; nothing is downloaded). Its train.py, model.py and
configurator.py are copied into a scratch directory twice, and changed:
- in both copies, the lines that assume a GPU per rank under DDP (this machine has none): the device a rank takes,
  torch.cuda.set_device, DDP's device_ids;
- in minitrain's copy, the lines that name DDP (PORT below): that is the whole port.
A character-level dataset is made from minitrain's own text (train.bin, val.bin and meta.pkl, nanoGPT's format).
Each copy runs under torchrun on 2 ranks (gloo, float32, no compile), uninterrupted to ITERS, then resumed from the
checkpoint its rank 0 saved to ITERS * 3/2; every loss rank 0 prints is recorded.
"""
from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from record import RESULTS, write_result

# (nanoGPT's line, what it becomes) for each copy; each must occur exactly once.
ON_THE_CPU = [("device = f'cuda:{ddp_local_rank}'", "device = 'cpu'"),
              ("torch.cuda.set_device(device)", "pass  # no GPU")]
DDP_ON_THE_CPU = [("model = DDP(model, device_ids=[ddp_local_rank])", "model = DDP(model)")]
PORT = [("from torch.nn.parallel import DistributedDataParallel as DDP", "import minitrain"),
        ("model = DDP(model, device_ids=[ddp_local_rank])", "model, optimizer = minitrain.prepare(model, optimizer)"),
        ("raw_model = model.module if ddp else model # unwrap DDP container if needed", "raw_model = model")]
SETTINGS = ["--dataset=port", "--device=cpu", "--compile=False", "--dtype=float32", "--backend=gloo",
            "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=4",
            "--gradient_accumulation_steps=4", "--eval_interval=10", "--eval_iters=4", "--log_interval=1",
            "--warmup_iters=4", "--learning_rate=3e-3", "--min_lr=3e-4", "--always_save_checkpoint=True"]
LOSS = re.compile(r"^iter (\d+): loss (\d+\.\d+)", re.M)
EVAL = re.compile(r"^step (\d+): train loss (\d+\.\d+), val loss (\d+\.\d+)", re.M)


def copy_of(nanogpt: Path, to: Path, swaps: list[tuple[str, str]]) -> Path:
    to.mkdir(parents=True)
    for name in ("model.py", "configurator.py"):
        shutil.copy(nanogpt / name, to / name)
    text = (nanogpt / "train.py").read_text()
    for theirs, ours in swaps:
        if text.count(theirs) != 1:
            raise SystemExit(f"{nanogpt / 'train.py'} does not hold `{theirs}` once: another nanoGPT than this "
                             "script knows")
        text = text.replace(theirs, ours)
    (to / "train.py").write_text(text)
    return to


def dataset(to: Path) -> None:
    """nanoGPT's layout: data/port/{train,val}.bin of uint16 ids, meta.pkl with the vocabulary's size."""
    import numpy as np

    text = "".join(p.read_text() for p in sorted((Path(__file__).parent.parent / "src/minitrain/corpora").glob("*.txt")))
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    (to / "data" / "port").mkdir(parents=True)
    cut = int(0.9 * len(ids))
    ids[:cut].tofile(to / "data" / "port" / "train.bin")
    ids[cut:].tofile(to / "data" / "port" / "val.bin")
    with open(to / "data" / "port" / "meta.pkl", "wb") as f:  # nanoGPT reads its vocabulary size from here
        pickle.dump({"vocab_size": len(chars)}, f)


def run(copy: Path, *extra: str) -> dict:
    """One torchrun launch of a copy; rank 0's losses by iteration."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train.py", *SETTINGS, f"--out_dir={copy / 'out'}", *extra]
    proc = subprocess.run(command, cwd=copy, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"{copy.name}/train.py {' '.join(extra)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {"train": {int(i): float(loss) for i, loss in LOSS.findall(proc.stdout)},
            "eval": {int(i): [float(a), float(b)] for i, a, b in EVAL.findall(proc.stdout)}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--iters", type=int, default=20, help="iterations uninterrupted; the resumed run goes on "
                        "to 3/2 of it")
    parser.add_argument("--out", default=str(RESULTS / "nanogpt_port.json"))
    args = parser.parse_args(argv)
    revision = subprocess.run(["git", "-C", str(args.nanogpt), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory() as scratch:
        runs = {}
        for name, swaps in (("ddp", ON_THE_CPU + DDP_ON_THE_CPU), ("minitrain", ON_THE_CPU + PORT)):
            copy = copy_of(args.nanogpt, Path(scratch) / name, swaps)
            dataset(copy)
            first = run(copy, f"--max_iters={args.iters}", f"--lr_decay_iters={args.iters * 3 // 2}")
            resumed = run(copy, f"--max_iters={args.iters * 3 // 2}", f"--lr_decay_iters={args.iters * 3 // 2}",
                          "--init_from=resume")
            runs[name] = {"uninterrupted": first, "resumed": resumed}
            print(f"{name}: {len(first['train'])} + {len(resumed['train'])} iterations", flush=True)
    write_result(args.out, __file__, argv, {"nanogpt": revision, "port": [ours for _, ours in PORT],
                                            "runs": runs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
