"""What minitrain makes is freed when its owner lets go: a closed Trainer, and a model and optimizer prepared in a
session that cleanup() ended, leave nothing behind: their hooks are off the model, so autograd no longer keeps the
strategy, its flat buffers and the optimizer state alive; and no gloo thread outlives the session, although the
user's torch optimizer imported torch._dynamo after the process group was joined."""
from __future__ import annotations

import gc
import os
import weakref

import pytest

from tests.helpers.dist import run_ranks


def _alive(refs: dict) -> list[str]:
    gc.collect()
    return sorted(name for name, ref in refs.items() if ref() is not None)


def _trainers_then_prepared_models(topo, out):
    import functools
    from pathlib import Path

    import torch

    import minitrain
    from minitrain.train.run_config import run_config
    from minitrain.train.trainer import Trainer

    left = {}
    for zero, mode in ((0, "bucketed"), (0, "torch"), (2, "bucketed"), (3, "bucketed")):
        cfg = run_config(cli_values={"model.preset": "tiny", "train.zero": zero, "ddp.mode": mode, "train.steps": 1,
                                     "train.log_every": 0, "out": out})
        with Trainer(cfg, topo) as trainer:
            trainer.train_step()
            refs = {"trainer": weakref.ref(trainer), "strategy": weakref.ref(trainer.strategy),
                    "model": weakref.ref(trainer.model)}
        del trainer
        left[f"trainer zero={zero} {mode}"] = _alive(refs)

    minitrain.init_distributed(topology=topo)
    refs = {}
    for zero in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        model, optimizer = minitrain.prepare(model, functools.partial(torch.optim.AdamW, lr=1e-3), zero=zero)
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        refs[f"model zero={zero}"], refs[f"optimizer zero={zero}"] = weakref.ref(model), weakref.ref(optimizer)
        del model, optimizer
    minitrain.cleanup()  # ends the session: hooks off, the process group left
    left["prepared"] = _alive(refs)
    threads = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return left, sorted(name for name in threads if "gloo" in name)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_a_closed_trainer_and_a_cleaned_up_session_are_freed(tmp_path):
    for left, gloo_threads in run_ranks(_trainers_then_prepared_models, 2, str(tmp_path)):
        assert len(left) == 5 and not any(left.values()), f"still alive after close: {left}"
        assert not gloo_threads, f"gloo threads left after cleanup(): {gloo_threads}"


def test_a_closed_strategy_refuses_to_step():
    # Its hooks are off, so backward no longer syncs its gradients: an update from it would be silently wrong.
    import functools

    import torch

    import minitrain

    model = torch.nn.Linear(4, 2)
    model, optimizer = minitrain.prepare(model, functools.partial(torch.optim.SGD, lr=0.1), zero=1)
    minitrain.cleanup()
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="closed"):
        optimizer.step()
