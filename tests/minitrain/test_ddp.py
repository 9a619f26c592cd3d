"""The DDP lab, as its text is written: `minitrain.ddp`'s names, `make_shard` in `minitrain.data`, and the
experiment experiments/35-ddp-cpu/train.py run under torchrun with the lab's stop conditions."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import minitrain
from minitrain import ddp
from minitrain.data import LAB_EXAMPLES, LAB_SEQ_LEN, LAB_VOCAB, make_corpus, make_shard

# This directory is no package: a `minitrain` package here would shadow the library.
from tests.helpers.dist import run_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_labs_wrapper_is_the_librarys_own_functions():
    assert ddp.wrap_for_ddp is minitrain.wrap_for_ddp and ddp.is_main_process is minitrain.is_main_process
    assert ddp.barrier is minitrain.barrier and ddp.cleanup is minitrain.cleanup
    assert ddp.init_distributed() == (0, 1)  # no torchrun: rank 0 of 1


def test_make_shard_gives_each_rank_every_world_size_th_example_without_overlap():
    for world in (1, 2, 3, 4):
        shards = [make_shard(rank, world) for rank in range(world)]
        everything = make_shard(0, 1)
        for rank, shard in enumerate(shards):
            assert torch.equal(shard, everything[rank::world])  # index % world_size == rank
        rows = {tuple(row.tolist()) for shard in shards for row in shard}
        assert sum(len(s) for s in shards) == len(everything) == len(rows)  # no overlap, full coverage


def test_make_shard_examples_are_the_corpus_windows_the_lab_names():
    # Example i is tokens[i*T : i*T + T + 1]: inputs and targets overlap by all but one token, and each example's
    # last token is the next one's first.
    everything = make_shard(0, 1)
    T = LAB_SEQ_LEN
    tokens = torch.from_numpy(make_corpus(0, LAB_EXAMPLES * T + 1, LAB_VOCAB).astype(np.int64))
    assert everything.shape == (LAB_EXAMPLES, T + 1)
    for i in (0, 1, LAB_EXAMPLES // 2, LAB_EXAMPLES - 1):
        assert torch.equal(everything[i], tokens[i * T:i * T + T + 1]), i


def test_experiment_35_meets_the_labs_stop_conditions(tmp_path):
    result = run_cli(str(ROOT / "experiments/35-ddp-cpu/train.py"), "--out", str(tmp_path), script=True,
                     torchrun_nproc=2, timeout_s=180)
    assert result.returncode == 0, result.stdout + result.stderr
    # 1. every step timed, and the loss fell
    rows = [json.loads(line) for line in (tmp_path / "timings.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 101)) and rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["step_ms"] > 0 and r["allreduce_ms"] > 0 for r in rows)
    # 2. the manifest: all-reduce p50/p95, tokens/s at 1 and 2 processes, and why they differ here
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert 0 < manifest["allreduce_ms"]["p50"] <= manifest["allreduce_ms"]["p95"]
    assert set(manifest["tokens_per_s"]) == {"1", "2"} and all(v > 0 for v in manifest["tokens_per_s"].values())
    assert "CPU core" in manifest["why"] and "all-reduce" in manifest["why"]
    # 3. the plot
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 4. and 5. each rank's state, tensors only, and the replicas equal
    states = [torch.load(tmp_path / f"state-rank-{r}.pt", weights_only=True) for r in range(2)]
    assert states[0].keys() == states[1].keys() and all(isinstance(v, torch.Tensor) for v in states[0].values())
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], atol=1e-5, rtol=0)
