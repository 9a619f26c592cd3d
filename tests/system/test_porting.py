"""A user's own training script, written for DDP or for FSDP2, ported to minitrain by swapping only the lines
that name DDP's or FSDP2's calls: it trains as it did there (float64, to 1e-12), resumes as it did, or is stopped
within seconds with one message that names each rank's line. The scripts (tests/helpers/user_scripts/) run as torchrun
runs them: their own init_process_group with its default timeout, rank 0 alone evaluating and saving."""
from __future__ import annotations

import difflib
import json
import re
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_script

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parents[1] / "helpers" / "user_scripts"
DDP_SCRIPT = SCRIPTS / "ddp_train.py"
FSDP2_SCRIPT = SCRIPTS / "fsdp2_train.py"
TOL = 1e-12
# Every line a port changes, as (DDP's or FSDP2's, minitrain's): all the porting there is.
DDP_PORT = [
    ("from torch.nn.parallel import DistributedDataParallel as DDP  # DDP\n", "import minitrain\n"),
    ("    model = DDP(model)  # DDP\n", "    model, optimizer = minitrain.prepare(model, optimizer, zero=zero)\n"),
    ("raw_model = model.module if ddp else model  # DDP\n", "raw_model = model\n"),
]
FSDP2_PORT = [
    ("from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # FSDP2\n"
     "                                                     get_optimizer_state_dict)  # FSDP2\n"
     "from torch.distributed.fsdp import fully_shard  # FSDP2\n", "import minitrain\n"),
    ("for layer in model.layers:  # FSDP2\n    fully_shard(layer)  # FSDP2\nfully_shard(model)  # FSDP2\n", ""),
    ('optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.1)\n',
     'optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.1)\n'
     "model, optimizer = minitrain.prepare(model, optimizer, zero=3)\n"),
    ('    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])  # FSDP2\n',
     '    norm = minitrain.clip_grad_norm_(model, config["grad_clip"])\n'),
    ("options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # FSDP2\n", ""),
    ('state = {"model": get_model_state_dict(model, options=options),  # FSDP2\n'
     '         "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}  # FSDP2\n',
     'state = {"model": minitrain.full_state_dict(model), "optimizer": optimizer.state_dict()}\n'),
]
# Stopped "within seconds": the bound leaves room for a loaded machine, and is far below what a hang would take
# (the watch speaks only at the process group's timeout, torch's default 30 minutes).
STOPPED_WITHIN_S = 60


def _ported(script: Path, swaps, to: Path) -> Path:
    text = script.read_text()
    for theirs, ours in swaps:
        assert text.count(theirs) == 1, theirs
        text = text.replace(theirs, ours)
    to.write_text(text)
    return to


def _changed_lines(a: Path, b: Path) -> int:
    diff = difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), n=0, lineterm="")
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def _run(script: Path, out: Path, **settings) -> list[dict]:
    """The script on 2 ranks; every rank's record (it must succeed)."""
    out.mkdir(parents=True, exist_ok=True)
    results = run_script(script, 2, json.dumps({"out_dir": str(out), **settings}), logs=out, timeout_s=120)
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{output}"
    return [json.loads((out / f"record-rank{r}.json").read_text()) for r in range(2)]


def _same_losses(ours: list[dict], theirs: list[dict], from_iter: int = 0) -> None:
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for part in ("train", "eval"):
            keys = [k for k in b[part] if int(k) >= from_iter]
            assert set(keys) <= set(a[part]) and (keys or part == "eval"), (part, rank, sorted(a[part]), keys)
            for k in keys:
                torch.testing.assert_close(a[part][k], b[part][k], rtol=0, atol=TOL, msg=f"{part} {k} rank {rank}")


def _line_of(path: Path, text: str) -> int:
    [line] = [i + 1 for i, source in enumerate(path.read_text().splitlines()) if text in source]
    return line


def test_a_ddp_script_ported_in_three_lines_trains_and_resumes_as_under_ddp(tmp_path):
    """nanoGPT's shape at ZeRO-0: every rank seeding its own model, the optimizer made (and loaded on resume)
    before the wrap, require_backward_grad_sync, torch's clip, rank-0-only evaluation and torch.save of
    optimizer.state_dict(), destroy_process_group: the losses of every iteration on every rank are DDP's, in an
    uninterrupted run and in one resumed from the checkpoint rank 0 saved alone."""
    ours = _ported(DDP_SCRIPT, DDP_PORT, tmp_path / "train.py")
    assert _changed_lines(DDP_SCRIPT, ours) <= 2 * 3  # three lines out, three in
    iters = {"max_iters": 7, "eval_interval": 3}
    ddp = _run(DDP_SCRIPT, tmp_path / "ddp", **iters)
    uninterrupted = _run(ours, tmp_path / "ours", **iters)
    _same_losses(uninterrupted, ddp)
    # Stopped after iteration 4 (rank 0 saved at 3), then resumed from that checkpoint to the end.
    _run(ours, tmp_path / "resumed", max_iters=4, eval_interval=3)
    resumed = _run(ours, tmp_path / "resumed", init_from="resume", **iters)
    _same_losses(resumed, ddp, from_iter=3)
    # The checkpoint is torch's own: the DDP script resumes from minitrain's last (iteration 6) as DDP's would.
    (tmp_path / "ddp-from-ours").mkdir()
    (tmp_path / "ddp-from-ours" / "ckpt.pt").write_bytes((tmp_path / "resumed" / "ckpt.pt").read_bytes())
    _same_losses(_run(DDP_SCRIPT, tmp_path / "ddp-from-ours", init_from="resume", **iters), ddp, from_iter=6)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_at_zero_1_to_3_the_same_port_is_stopped_within_seconds_naming_each_ranks_line(tmp_path, zero):
    """Where DDP's rank-0-only habits cannot hold (ZeRO-1's optimizer state is sharded, ZeRO-2's gradients, ZeRO-3's
    parameters), every rank stops at once with one message naming its line, never a hang or gloo's words."""
    ours = _ported(DDP_SCRIPT, DDP_PORT, tmp_path / "train.py")
    start = time.monotonic()
    results = run_script(ours, 2, json.dumps({"out_dir": str(tmp_path), "zero": zero, "max_iters": 7,
                                              "eval_interval": 3}), logs=tmp_path, timeout_s=120)
    took = time.monotonic() - start
    assert all(code != 0 for code, _ in results), results
    assert took < STOPPED_WITHIN_S, took
    line = {"save": _line_of(ours, '"optimizer": optimizer.state_dict()'), "backward": _line_of(ours, "loss.backward()"),
            "clip": _line_of(ours, "torch.nn.utils.clip_grad_norm_"),
            # The evaluation's forward and the training's are the same words, each on the line before these:
            "eval": _line_of(ours, "losses[k] = loss.item()") - 1,
            "forward": _line_of(ours, "loss = loss / gradient_accumulation_steps") - 1}
    site = {what: f"train.py:{n}" for what, n in line.items()}
    expected = {
        1: f"rank 0 is in optimizer.state_dict() at {site['save']}; rank 1 is in backward at {site['backward']}: at "
           "ZeRO-1 each rank holds a shard of the optimizer's state",
        2: "the gradient of 'wte.weight' is sharded across ranks at ZeRO-2",
        3: f"rank 0 is in the model's forward at {site['eval']}; rank 1 is in the model's forward at "
           f"{site['forward']}: at ZeRO-3 each rank holds a shard of the parameters",
    }[zero]
    for rank, (_, output) in enumerate(results):
        assert expected in output, f"rank {rank}:\n{output}"
        assert "op.preamble" not in output and "Timeout" not in output, output
    if zero == 2:  # torch's clip, on every rank: the traceback names the line
        assert all(f'File "{ours}", line {line["clip"]}' in out for _, out in results), results


def test_an_fsdp2_loop_ported_trains_as_under_fsdp2(tmp_path):
    """fully_shard per block, the optimizer made after, set_requires_gradient_sync, get_model_state_dict and
    get_optimizer_state_dict to save: swapped for prepare(zero=3), minitrain.clip_grad_norm_, full_state_dict and
    optimizer.state_dict(), the same losses, norms, parameters and optimizer state."""
    ours = _ported(FSDP2_SCRIPT, FSDP2_PORT, tmp_path / "train.py")
    fsdp2 = _run(FSDP2_SCRIPT, tmp_path / "fsdp2")
    mine = _run(ours, tmp_path / "ours")
    for a, b in zip(mine, fsdp2):
        for step in b["train"]:
            torch.testing.assert_close(a["train"][step], b["train"][step], rtol=0, atol=TOL)
    theirs = torch.load(tmp_path / "fsdp2" / "final.pt", weights_only=True)
    saved = torch.load(tmp_path / "ours" / "final.pt", weights_only=True)
    assert saved["model"].keys() == theirs["model"].keys()
    for key, value in theirs["model"].items():
        torch.testing.assert_close(saved["model"][key], value, rtol=0, atol=TOL, msg=key)
    # DCP keys the optimizer's state by parameter name, torch's own format by index in the param groups' order.
    names = theirs["optimizer"]["param_groups"][0]["params"]
    for index, name in enumerate(names):
        for kind, value in theirs["optimizer"]["state"][name].items():
            torch.testing.assert_close(saved["optimizer"]["state"][index][kind], value, rtol=0, atol=TOL,
                                       msg=f"{name} {kind}")
    assert re.sub(r"'params': \[[^]]*\]", "", str(saved["optimizer"]["param_groups"])) == \
        re.sub(r"'params': \[[^]]*\]", "", str(theirs["optimizer"]["param_groups"]))
