import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from minitrain import checkpoint
from minitrain.checkpoint import CheckpointError
from minitrain.train.run_config import run_config
from minitrain.parallel.core.sync_stats import same_state
from minitrain.runtime.topology import Topology
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_ranks
from tests.helpers.tamper import resign_file


def _config(world, zero=1, steps=6, dtype="float32", batch_size=4):
    return run_config(cli_values={"train.zero": zero, "train.steps": steps, "dist.nproc": world,
                                    "train.dtype": dtype, "train.batch_size": batch_size,
                                    "train.log_every": 0})


def _save_reload_resume(topo, root):
    """Save at step 3 of 6, reload into a fresh trainer, re-save, resume to 6."""
    root = Path(root)
    trainer = Trainer(_config(topo.world_size), topo)
    for _ in range(3):
        trainer.train_step()
    first = trainer.save_checkpoint(root / "a")
    saved = trainer.strategy.state_snapshot()
    losses = [trainer.train_step().loss for _ in range(3)]
    final = trainer.strategy.state_snapshot()

    fresh = Trainer(_config(topo.world_size), topo)
    fresh.load_checkpoint(first)
    reload_equal = same_state(fresh.strategy.state_snapshot(), saved) and fresh.step == 3
    second = fresh.save_checkpoint(root / "b")  # same state saved again
    resumed_losses = [fresh.train_step().loss for _ in range(3)]
    return {"reload_equal": reload_equal, "resume_equal": same_state(fresh.strategy.state_snapshot(), final),
            "losses": (losses, resumed_losses), "dirs": (str(first), str(second))}


def test_round_trip_is_byte_equal_and_resume_bit_identical(tmp_path):
    results = run_ranks(_save_reload_resume, 2, str(tmp_path))
    assert all(r["reload_equal"] and r["resume_equal"] for r in results)
    assert results[0]["losses"][0] == results[0]["losses"][1]
    first, second = map(Path, results[0]["dirs"])
    for name in ("rank-00000.safetensors", "rank-00001.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    manifest = json.loads((first / "manifest.json").read_text())
    assert (manifest["step"], manifest["world_size"], manifest["strategy"]) == (3, 2, "zero1")
    assert manifest["model"]["d_model"] == 32 and manifest["flat"]["padding"] == 0
    pieces = [t["pieces"] for t in manifest["tensors"] if t["key"] == "optim.exp_avg"]
    # Each rank's half of the logical vector, cut at tensor boundaries: [at, lo, hi] with at = lo - rank's start.
    assert [(p[0][1], p[-1][2]) for p in pieces] == [(0, 15040), (15040, 30080)]
    assert all(at == lo - p[0][1] for p in pieces for at, lo, _ in p)
    assert (tmp_path / "a" / "latest").read_text().strip() == "step-000003"
    assert not list(tmp_path.glob("a/.tmp-*"))  # the temporary directory was renamed away


@pytest.fixture
def saved(tmp_path) -> Path:
    """A one-process checkpoint at step 2 (no ranks needed: corruption is checked on load)."""
    trainer = Trainer(_config(1, zero=0), Topology.single())
    trainer.train_step()
    trainer.train_step()
    return trainer.save_checkpoint(tmp_path / "checkpoints")


def _load_fresh(path):
    Trainer(_config(1, zero=0), Topology.single()).load_checkpoint(path)


def test_flipped_byte_is_refused_naming_the_file(saved):
    shard = saved / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors is corrupt: sha256"):
        _load_fresh(saved)


def test_truncated_shard_missing_manifest_and_garbage_latest_are_refused(saved):
    shard = saved / "rank-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors has 100 bytes"):
        checkpoint.verify(saved)
    (saved / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.verify(saved)
    (saved.parent / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="latest names"):
        checkpoint.verify(saved.parent)
    assert issubclass(CheckpointError, Exception)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_is_never_executed(saved, tmp_path):
    payload = _Payload()
    payload.marker = tmp_path / "pwned"
    shard = saved / "rank-00000.safetensors"
    shard.write_bytes(pickle.dumps(payload))
    with pytest.raises(CheckpointError, match="manifest says"):  # refused by size and checksum...
        _load_fresh(saved)
    resign_file(saved, shard.name)  # ...and by format, even if re-signed
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        _load_fresh(saved)
    assert not payload.marker.exists()


def test_different_model_is_refused(saved):
    cfg = _config(1, zero=0)
    cfg.model.n_layer = 3
    with pytest.raises(CheckpointError, match="different model"):
        Trainer(cfg, Topology.single()).load_checkpoint(saved)


def test_find_latest_and_resolve(saved, tmp_path):
    assert checkpoint.find_latest(tmp_path) == saved
    assert checkpoint.resolve(tmp_path) == saved  # a run directory works too
    assert checkpoint.find_latest(tmp_path / "elsewhere") is None


def _zero1_float64_with_checkpoint(topo, root):
    trainer = Trainer(_config(topo.world_size, zero=1, dtype="float64"), topo)
    for _ in range(3):
        trainer.train_step()
    path = trainer.save_checkpoint(root)
    losses = [trainer.train_step().loss for _ in range(3)]
    return str(path), losses, trainer.strategy.flat.data[:trainer.strategy.flat.numel].clone()


def test_checkpoint_from_two_zero1_ranks_loads_into_one_dp_process(tmp_path):
    # Tensors are stored as slices of the logical flat vector, so the layout that wrote them
    # does not matter: 2 ranks x batch 4 with ZeRO-1 continue as 1 process x batch 8 with DP.
    path, losses, params = run_ranks(_zero1_float64_with_checkpoint, 2, str(tmp_path))[0]
    single = Trainer(_config(1, zero=0, dtype="float64", batch_size=8), Topology.single())
    single.load_checkpoint(path)
    assert single.step == 3
    single_losses = [single.train_step().loss for _ in range(3)]
    assert max(abs(a - b) for a, b in zip(losses, single_losses)) <= 1e-12
    assert (single.strategy.flat.data[:single.strategy.flat.numel] - params).abs().max().item() <= 1e-12


@pytest.mark.parametrize("renamed", [False, True])
def test_a_re_save_cut_short_is_settled_by_the_next_save(saved, renamed):
    # A re-save moves the old copy aside (.old-step-N, `latest` naming it), renames the new one into place, then
    # removes the old: cut off in between, the next save settles it. Not renamed yet: the old copy is the only one
    # and returns to its name; renamed: the new one is complete, and the old goes.
    root = saved.parent
    old = root / f".old-{saved.name}"
    if renamed:
        shutil.copytree(saved, old)
    else:
        os.replace(saved, old)
    (root / "latest").write_text(old.name + "\n")
    trainer = Trainer(_config(1, zero=0), Topology.single())
    trainer.load_checkpoint(root)  # `latest` naming the moved copy is read as it is
    assert trainer.step == 2
    trainer.train_step()
    trainer.save_checkpoint(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest", saved.name, "step-000003"]
    checkpoint.verify(saved)


def test_saving_a_step_again_replaces_it_and_keeps_latest_valid(saved):
    trainer = Trainer(_config(1, zero=0), Topology.single())
    trainer.load_checkpoint(saved)
    assert trainer.save_checkpoint(saved.parent) == saved
    assert (saved.parent / "latest").read_text().strip() == saved.name
    assert sorted(p.name for p in saved.parent.iterdir()) == ["latest", saved.name]  # no .old-/.tmp- left
    checkpoint.verify(saved.parent)


def _draws() -> tuple:
    import random

    import numpy as np

    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()), \
        float(torch.rand(1))


def test_python_numpy_and_torch_random_streams_continue_after_resume(tmp_path):
    import random

    import numpy as np

    trainer = Trainer(_config(1), Topology.single())
    trainer.train_step()
    random.seed(5), np.random.seed(6), torch.manual_seed(7)  # streams the trainer's own seeding did not set
    random.gauss(0, 1), np.random.randn()  # leaves a cached Gaussian in both generators
    path = trainer.save_checkpoint(tmp_path)
    expected = _draws()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # anything else in between
    Trainer(_config(1), Topology.single()).load_checkpoint(path)
    assert _draws() == expected
    manifest = json.loads((path / "manifest.json").read_text())
    assert {t["key"] for t in manifest["tensors"] if "rank" in t} == set(checkpoint.RNG_KEYS)


def test_a_full_disk_while_moving_latest_is_one_clean_error(tmp_path, monkeypatch):
    import errno

    from minitrain.checkpoint import files

    trainer = Trainer(_config(1, zero=0), Topology.single())
    trainer.train_step()
    first = trainer.save_checkpoint(tmp_path)
    real_replace = os.replace

    def full_disk(src, dst):
        if Path(dst).name == "latest":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", full_disk)
    trainer.train_step()
    with pytest.raises(CheckpointError, match="writing .*latest failed: No space left on device"):
        trainer.save_checkpoint(tmp_path)
    assert (tmp_path / "latest").read_text().strip() == first.name and not (tmp_path / "latest.tmp").exists()
