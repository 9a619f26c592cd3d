"""--train.compile: each block's forward compiled (inductor, C++ on the CPU), composed with activation
checkpointing and ZeRO's hooks, trains as eager does within float32 rounding."""
import torch


from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_ranks

CASES = [(0, "none"), (3, "block"), (3, "selective")]  # (ZeRO stage, activation checkpointing)


def _compiled_and_eager(topo):
    from torch._dynamo.utils import counters

    out = {}
    for zero, ac in CASES:
        runs = []
        for compiled in (False, True):
            cfg = run_config(cli_values={"dist.nproc": topo.world_size, "train.zero": zero, "train.compile": compiled,
                                           "train.activation_checkpointing": ac, "train.log_every": 0})
            trainer = Trainer(cfg, topo)
            runs.append(([trainer.train_step().loss for _ in range(3)], trainer.strategy.full_params()))
        out[(zero, ac)] = runs
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def test_compiled_blocks_train_as_eager_under_zero_and_recomputation():
    result = run_ranks(_compiled_and_eager, 2, timeout_s=600)[0]
    assert result["graphs"] > 0  # dynamo did compile
    for case in CASES:
        (eager_losses, eager_params), (losses, params) = result[case]
        torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0, msg=str(case))
        torch.testing.assert_close(params, eager_params, rtol=0, atol=1e-5, msg=str(case))
