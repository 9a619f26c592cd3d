"""How reliably torchrun's --max-restarts brings a killed run back, per rendezvous setting.

Each trial: `torchrun --nproc-per-node=2 --max-restarts=1 -m minitrain train --steps 20
--ckpt-every-steps 5 --resume auto`, with rank 1 SIGKILLed as step 7 starts (`--fault.kind
sigkill`). torchrun restarts both ranks; they resume from step 5. A trial passes when torchrun
exits 0, the output says it resumed from step-000005, and every shard file of the final
checkpoint is byte-equal to an uninterrupted run's. Settings: torchrun's default static
rendezvous and `--standalone` (c10d), each with and without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(workers build their own store instead of sharing the agent's).

    .venv/bin/python benchmarks/torchrun_restarts.py [--trials 10] [--label now] [--out runs/bench-restarts]

Every trial's run directory is kept under --out; benchmarks/results/torchrun_restarts_{label}.json gets the
command, the machine, which minitrain ran (a column of the table in docs/fault-tolerance.md per label: an older commit's
src/ on PYTHONPATH measures the code as it was) and every trial.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from record import RESULTS, write_result  # benchmarks/record.py

import minitrain
from minitrain.runtime.launch import free_port
from minitrain.train.metrics import format_table

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


TRIAL_MARK = "MINITRAIN_RESTART_TRIAL"


def _kill_marked(mark: str) -> None:
    """SIGKILL every process whose environment carries TRIAL_MARK=mark."""
    needle = f"{TRIAL_MARK}={mark}".encode()
    for proc_dir in Path("/proc").iterdir():
        try:
            if proc_dir.name.isdigit() and needle in (proc_dir / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc_dir.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # gone already, or not ours to read


def trial(rdzv: list[str], env: dict, out: Path, reference: dict[str, bytes]) -> dict:
    start = time.monotonic()
    # torchrun starts each rank in a session of its own, and a rank can outlive it (holding the output pipe,
    # so waiting for the output would never end): a hung trial's processes are found by a mark in their
    # environment and killed, all of them.
    mark = f"{os.getpid()}-{out.name}"
    proc = subprocess.Popen(torchrun_cmd(rdzv, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env, TRIAL_MARK: mark})
    try:
        text, _ = proc.communicate(timeout=TRIAL_TIMEOUT_S)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_marked(mark)
        text, _ = proc.communicate()
        rc = "timeout"
    resumed = "resumed from" in text and "step-000005 at step 5" in text
    identical = bool(reference) and final_files(out) == reference
    return {"rc": rc, "resumed_from_5": resumed, "bit_identical": identical, "passed": rc == 0 and resumed and identical,
            "wall_s": round(time.monotonic() - start, 1), "tail": text[-600:] if rc != 0 else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--label", default="now", help="names the result file and the column of docs/fault-tolerance.md's table (default now)")
    parser.add_argument("--out", default="runs/bench-restarts")
    args = parser.parse_args()
    root = Path(args.out) / args.label
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
    src = Path(minitrain.__file__).resolve().parent.parent
    path = write_result(RESULTS / f"torchrun_restarts_{args.label}.json", __file__, None,
                        {"label": args.label, "minitrain_src": str(src), "trials": args.trials, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
