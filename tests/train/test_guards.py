"""NaN/Inf guard: a step whose gradients are not finite changes nothing, on every rank."""
import pytest
import torch


from minitrain.train.run_config import run_config
from minitrain.parallel.core.sync_stats import same_state
from minitrain.train.guards import NonFiniteError
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_ranks


def _poison_rank_one(topo, zero):
    cfg = run_config(cli_values={"train.zero": zero, "dist.nproc": topo.world_size, "train.log_every": 0,
                                   "train.max_skipped_steps": 2})
    trainer = Trainer(cfg, topo)
    for _ in range(2):
        trainer.train_step()
    poison = None
    if topo.rank == 1:  # one rank's loss (and so its gradients) turns NaN
        poison = trainer.model.head.register_forward_hook(lambda _m, _args, out: out * float("nan"))
    before = trainer.strategy.state_snapshot()
    record = trainer.train_step()
    unchanged = same_state(trainer.strategy.state_snapshot(), before)
    if poison is not None:
        poison.remove()
    after = trainer.train_step()  # training goes on
    moved = not same_state(trainer.strategy.state_snapshot(), before)
    if topo.rank == 1:
        trainer.model.head.register_forward_hook(lambda _m, _args, out: out * float("nan"))
    try:
        for _ in range(3):
            trainer.train_step()
        aborted = ""
    except NonFiniteError as e:
        aborted = str(e)
    return {"skipped": record.skipped, "unchanged": unchanged, "next_finite": torch.isfinite(torch.tensor(after.loss)),
            "moved": moved, "counted": trainer.skipped_steps, "aborted": aborted}


@pytest.mark.parametrize("zero", [0, 3])
def test_nan_on_one_rank_skips_the_step_on_every_rank(zero):
    for rank in run_ranks(_poison_rank_one, 2, zero):
        assert rank["skipped"] and rank["unchanged"], "parameters or optimizer state changed on a NaN step"
        assert rank["next_finite"] and rank["moved"]
        assert rank["counted"] == 4  # 1, then 3 in a row; the third in a row is over the limit of 2
        assert "gradients were NaN/Inf 3 steps in a row" in rank["aborted"]
