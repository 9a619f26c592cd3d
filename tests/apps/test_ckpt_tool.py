"""`minitrain ckpt inspect | verify | consolidate` on a real sharded checkpoint."""
import shutil

import pytest
import torch
from safetensors.torch import load_file

from minitrain import checkpoint
from minitrain.config import build_config
from minitrain.models.minigpt.model import MiniGPT

from tests.helpers.dist import run_cli, run_main


@pytest.fixture(scope="module")
def zero3_tied(tmp_path_factory):
    """A 2-rank ZeRO-3 run with tied embeddings: shards, per-unit pieces and the shared unit."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    proc = run_cli("train", "--nproc", "2", "--zero", "3", "--model.tie_weights", "true", "--steps", "3",
                   "--ckpt-every-steps", "3", "--train.log_every", "0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def test_consolidate_gives_a_state_dict_minigpt_loads(zero3_tied, tmp_path):
    target = tmp_path / "model.safetensors"
    proc = run_main("ckpt", "consolidate", str(zero3_tied), str(target))
    assert proc.returncode == 0, proc.stderr
    state = load_file(str(target))
    assert {"tok_emb.weight", "head.weight"} <= state.keys()  # tied: both names, as state_dict() has them
    model = MiniGPT(build_config(cli_values={"model.tie_weights": True}).model)
    model.load_state_dict(state)  # strict: every key, every shape
    step_dir, manifest = checkpoint.verify(zero3_tied)
    expected = checkpoint.assemble_flat(step_dir, manifest)["params"]
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(got, expected)


def test_verify_and_inspect(zero3_tied, tmp_path):
    ok = run_cli("ckpt", "verify", str(zero3_tied))  # the command itself; the rest in-process (no rank starts)
    assert ok.returncode == 0 and "every sha256 matches" in ok.stdout
    shown = run_main("ckpt", "inspect", str(zero3_tied)).stdout
    assert "step 3; world size 2" in shown and "ZeRO-3" in shown and "rank-00001.safetensors" in shown

    broken = tmp_path / "broken"
    shutil.copytree(zero3_tied, broken)
    shard = next((broken / "checkpoints").glob("step-*/rank-00001.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    for action in ("verify", "inspect"):
        bad = run_main("ckpt", action, str(broken))
        assert bad.returncode == 1 and "rank-00001.safetensors is corrupt" in bad.stderr, bad.stderr
    # 2 is a usage error, never a verdict on a checkpoint: a path that is not there, a missing argument.
    missing = run_main("ckpt", "verify", str(tmp_path / "no-such-run"))
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr, missing.stderr
    assert run_main("ckpt", "verify").returncode == 2


def test_consolidate_refuses_a_bad_output_and_writes_nothing(zero3_tied, tmp_path):
    bad = run_main("ckpt", "consolidate", str(zero3_tied), str(tmp_path / "model.pt"))
    assert bad.returncode == 2 and "should end in .safetensors" in bad.stderr
    assert not list(tmp_path.iterdir())
