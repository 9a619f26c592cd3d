"""A run that continues at another world size (an elastic restart) is the same computation: `--global-batch`
fixes the examples per step whatever the number of ranks, and `--stop-at` ends a run at a step without
touching its schedule. On one machine; tests/system/test_multinode.py does it across nodes with torchrun.
"""
import pytest
import torch

from minitrain import checkpoint
from minitrain.checkpoint.reading import assemble_flat
from minitrain.config import ConfigError, RunConfig, build_config
from minitrain.train.resume import saved_run_config

from tests.helpers.dist import run_ranks
from tests.helpers.multinode import metric_rows, shards, train_each

RUN = ["--dtype", "float64", "--zero", "2", "--global-batch", "24", "--steps", "8", "--ckpt-every-steps", "4",
       "--train.log_every", "0"]


def _flat(out, step: int) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state as whole vectors, whatever world size wrote them."""
    return assemble_flat(*checkpoint.verify(out / "checkpoints" / checkpoint.step_dir_name(step)))


def test_four_ranks_then_two_equal_four_throughout_in_float64(tmp_path):
    whole, first, second = tmp_path / "whole", tmp_path / "first", tmp_path / "second"
    run_ranks(train_each, 4, [[*RUN, "--out", str(whole)], [*RUN, "--stop-at", "4", "--out", str(first)]])
    assert shards(first, 4) == shards(whole, 4)  # --stop-at changed nothing before it
    resume = first / "checkpoints" / checkpoint.step_dir_name(4)
    run_ranks(train_each, 2, [[*RUN, "--resume", str(resume), "--out", str(second)]])
    # The same examples in every step at 2 ranks as at 4: the same averaged gradient, summed in another order.
    ours, theirs = _flat(second, 8), _flat(whole, 8)
    assert ours.keys() == theirs.keys() and "params" in ours
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-12, msg=key)
    # 24 examples a step at either size: 6 per rank at 4 ranks, 12 at 2 (neither is the default --batch-size).
    assert [r["tokens"] for r in metric_rows(second)] == [r["tokens"] for r in metric_rows(whole)][4:]


def test_global_batch_sets_each_ranks_batch_and_refuses_what_does_not_divide():
    def cfg(nproc: int, **train) -> RunConfig:
        return build_config(cli_values={"dist.nproc": nproc, **{f"train.{k}": v for k, v in train.items()}})

    assert cfg(4, global_batch=24).validate().train.batch_size == 6
    assert cfg(2, global_batch=24, grad_accum=2).validate().train.batch_size == 6
    with pytest.raises(ConfigError, match="--global-batch 8 is not divisible by 3 data-parallel rank"):
        cfg(3, global_batch=8).validate()
    with pytest.raises(ConfigError, match="--stop-at 9 must be between 0"):
        cfg(1, stop_at=9, steps=8).validate()


def test_a_checkpoint_from_before_the_new_settings_still_resumes(tmp_path):
    saved = build_config().to_dict()
    for key in ("global_batch", "stop_at"):
        del saved["train"][key]
    assert saved_run_config(tmp_path, saved)["train"]["global_batch"] == 0
