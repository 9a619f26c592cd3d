"""How reliably torchrun's --max-restarts brings a killed run back, per rendezvous setting.

Each trial: `torchrun --nproc-per-node=2 --max-restarts=1 -m minitrain train --steps 20
--ckpt-every-steps 5 --resume auto`, with rank 1 SIGKILLed as step 7 starts (`--fault.kind
sigkill`). torchrun restarts both ranks; they resume from step 5. A trial passes when torchrun
exits 0, the output says it resumed from step-000005, and every shard file of the final
checkpoint is byte-equal to an uninterrupted run's. Settings: torchrun's default static
rendezvous and `--standalone` (c10d), each with and without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(workers build their own store instead of sharing the agent's).

    .venv/bin/python benchmarks/torchrun_restarts.py [--trials 10] [--out runs/bench-restarts]

Every trial's run directory is kept under --out, with results.json (command, machine, every trial).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from record import write_result  # benchmarks/record.py

from minitrain.launch import free_port
from minitrain.metrics import format_table

TRAIN = ["train", "--steps", "20", "--ckpt-every-steps", "5", "--train.log_every", "0"]
FAULT = ["--resume", "auto", "--fault.kind", "sigkill", "--fault.step", "7", "--fault.rank", "1"]
SETTINGS = {
    "static (default)": ([], {}),
    "static, no shared store": ([], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    "c10d --standalone": (["--standalone"], {}),
    "c10d --standalone, no shared store": (["--standalone"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
}
TRIAL_TIMEOUT_S = 120


def torchrun_cmd(rdzv: list[str], out: Path) -> list[str]:
    port = [] if rdzv else [f"--master-port={free_port()}"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1", "--max-restarts=1",
            *rdzv, *port, "-m", "minitrain", *TRAIN, *FAULT, "--out", str(out)]


def final_files(out: Path) -> dict[str, bytes]:
    step = out / "checkpoints" / "step-000020"
    return {f.name: f.read_bytes() for f in sorted(step.glob("rank-*.safetensors"))} if step.is_dir() else {}


def trial(rdzv: list[str], env: dict, out: Path, reference: dict[str, bytes]) -> dict:
    start = time.monotonic()
    try:
        proc = subprocess.run(torchrun_cmd(rdzv, out), capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S, check=False,
                              env={**os.environ, **env}, start_new_session=True)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        rc, text = "timeout", ""
    resumed = "resumed from" in text and "step-000005 at step 5" in text
    identical = bool(reference) and final_files(out) == reference
    return {"rc": rc, "resumed_from_5": resumed, "bit_identical": identical, "passed": rc == 0 and resumed and identical,
            "wall_s": round(time.monotonic() - start, 1), "tail": text[-600:] if rc != 0 else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--out", default="runs/bench-restarts")
    args = parser.parse_args()
    root = Path(args.out)
    ref_out = root / "reference"
    subprocess.run([sys.executable, "-m", "minitrain", *TRAIN, "--nproc", "2", "--out", str(ref_out)], check=True,
                   capture_output=True)
    reference = final_files(ref_out)
    results: dict[str, list[dict]] = {}
    for i in range(args.trials):  # interleaved, so machine noise hits every setting alike
        for name, (rdzv, env) in SETTINGS.items():
            out = root / f"{name.replace(' ', '_').replace(',', '').replace('(', '').replace(')', '')}-{i}"
            results.setdefault(name, []).append(trial(rdzv, env, out, reference))
            r = results[name][-1]
            print(f"trial {i} {name}: passed={r['passed']} rc={r['rc']} {r['wall_s']} s {r['tail'][-300:]!r}", flush=True)
    rows = [[name, f"{sum(r['passed'] for r in rs)}/{len(rs)}", sorted({str(r['rc']) for r in rs}),
             f"{sorted(r['wall_s'] for r in rs)[len(rs) // 2]:.1f}"] for name, rs in results.items()]
    print(format_table(["setting", "passed", "exit codes", "median wall s"], rows, "<>>>"))
    write_result(root / "results.json", __file__, None, {"trials": args.trials, "results": results})


if __name__ == "__main__":
    main()
