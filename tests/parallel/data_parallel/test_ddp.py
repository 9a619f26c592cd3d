"""Data parallel: ours (bucketed, naive) against PyTorch's DistributedDataParallel."""
import pytest
import torch
import torch.nn as nn

from minitrain.config import TrainConfig

from minitrain.train.run_config import run_config
from minitrain.train.optim import flat_adamw_factory
from minitrain.parallel.core.buckets import plan_buckets
from minitrain.parallel.core.config import ParallelConfig
from minitrain.parallel.data_parallel.data_parallel import BucketedDataParallel
from minitrain.parallel.core.flat_parameters import Segment
from minitrain.runtime.topology import Topology
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_ranks
from tests.helpers.numerics import key_bias_mask

pytestmark = pytest.mark.slow

MODES = ("naive", "bucketed", "torch")
STEPS = 5


def _config(world, mode, dtype="float64", batch_size=4, grad_accum=1, bucket_mb=25.0):
    return run_config(cli_values={
        "ddp.mode": mode, "train.dtype": dtype, "train.steps": STEPS, "train.batch_size": batch_size,
        "train.grad_accum": grad_accum, "ddp.bucket_mb": bucket_mb, "dist.nproc": world,
        "train.lr": 1e-2, "train.log_every": 0})


def _all_modes(topo, dtype):
    out = {}
    for mode in MODES:
        # Small buckets, so bucketed runs several overlapped all-reduces per step.
        trainer = Trainer(_config(topo.world_size, mode, dtype, bucket_mb=0.02), topo)
        records = [trainer.train_step() for _ in range(STEPS)]
        out[mode] = {"losses": [r.loss for r in records], "norms": [r.param_norm_per_rank for r in records],
                     "params": trainer.strategy.flat.data.clone()}
    return out


def test_key_bias_gradient_is_exactly_zero():
    trainer = Trainer(_config(1, "naive"), Topology.single())
    x, y = trainer.loader.next_batch()
    trainer.model(x, y).backward()
    grad = trainer.strategy.flat.grad
    mask = key_bias_mask(grad.numel())
    assert grad[mask].abs().max().item() <= 1e-15 < grad[~mask].abs().max().item()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_naive_and_bucketed_match_torch_ddp(world):
    f64 = run_ranks(_all_modes, world, "float64")
    f32 = run_ranks(_all_modes, world, "float32")
    for mode in ("naive", "bucketed"):
        ours, ref = f64[0][mode], f64[0]["torch"]
        assert (ours["params"] - ref["params"]).abs().max().item() <= 1e-12
        assert max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])) <= 1e-12
        ours, ref = f32[0][mode], f32[0]["torch"]
        keep = ~key_bias_mask(ours["params"].numel())  # see key_bias_mask
        torch.testing.assert_close(ours["params"][keep], ref["params"][keep], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        assert abs(ours["norms"][-1][0] - ref["norms"][-1][0]) < 1e-6
    for results in (f64, f32):
        for mode in MODES:
            # Every rank holds bit-identical parameters after every step.
            assert all(len(set(norms)) == 1 for norms in results[0][mode]["norms"])
            assert all(torch.equal(r[mode]["params"], results[0][mode]["params"]) for r in results)


def _accumulated_gradient(topo, mode, batch_size, grad_accum):
    trainer = Trainer(_config(topo.world_size, mode, batch_size=batch_size, grad_accum=grad_accum, bucket_mb=0.02),
                      topo)
    strategy, calls_before = trainer.strategy, topo.dp.stats.get("all_reduce")
    calls_before = calls_before.calls if calls_before else 0
    strategy.zero_grad()
    for micro in range(grad_accum):
        last = micro == grad_accum - 1
        with (strategy.no_sync() if not last else torch.enable_grad()):
            x, y = trainer.loader.next_batch()
            (strategy.module(x, y) / grad_accum).backward()
    strategy.finish_grad_sync()
    calls = (topo.dp.stats["all_reduce"].calls if "all_reduce" in topo.dp.stats else 0) - calls_before
    return strategy.flat.grad.clone(), calls, strategy.last_sync["buckets"]


@pytest.mark.parametrize("mode", ["bucketed", "torch"])
def test_no_sync_accumulation_equals_one_big_batch(mode):
    # 2 ranks x 4 micro-batches x batch 2 = the 16 examples one process sees with batch 16.
    results = run_ranks(_accumulated_gradient, 2, mode, 2, 4)
    single = Trainer(_config(1, "bucketed", batch_size=16), Topology.single())
    x, y = single.loader.next_batch()
    single.strategy.zero_grad()
    single.model(x, y).backward()
    for grad, calls, buckets in results:
        assert (grad - single.strategy.flat.grad).abs().max().item() <= 1e-12
        assert calls == buckets  # one all-reduce per bucket per step, not per micro-batch
        if mode == "bucketed":  # (torch DDP's first step uses one 1 MiB bucket, rebuilt later)
            assert buckets > 1


def _calls_per_step(topo, bucket_mb):
    trainer = Trainer(_config(topo.world_size, "bucketed", bucket_mb=bucket_mb), topo)
    counts = []
    for _ in range(2):
        trainer.train_step()
        counts.append(trainer.strategy.last_sync["allreduce_calls"])
    stats = topo.dp.stats["all_reduce"]
    return counts, len(trainer.strategy.buckets), stats.calls


def test_all_reduce_calls_equal_buckets_and_grow_as_buckets_shrink():
    big = run_ranks(_calls_per_step, 2, 25.0)[0]
    small = run_ranks(_calls_per_step, 2, 0.005)[0]
    assert big[0] == [1, 1] and big[1] == 1 and big[2] == 2  # counted by the comm layer too
    assert small[0] == [small[1]] * 2 and small[1] > 10 and small[2] == 2 * small[1]


def test_buckets_follow_reverse_registration_order_and_cap():
    segs = [Segment("a", 0, (10,)), Segment("b", 10, (300,)), Segment("c", 310, (20,)), Segment("d", 330, (30,))]
    buckets = plan_buckets(segs, cap_bytes=4 * 60, element_size=4)
    assert [b.names for b in buckets] == [["d", "c"], ["b"], ["a"]]  # b alone: larger than the cap
    assert [(b.start, b.stop) for b in buckets] == [(310, 360), (10, 310), (0, 10)]


class _PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).square().sum()


def _unused_parameter(topo):
    torch.manual_seed(0)
    model = _PartlyUsed()
    strategy = BucketedDataParallel(model, topo.dp, ParallelConfig(), flat_adamw_factory(TrainConfig()))
    model(torch.ones(2, 4)).backward()
    try:
        strategy.step(1e-3)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_parameter_without_gradient_is_named_not_a_hang():
    messages = run_ranks(_unused_parameter, 2, timeout_s=60)
    for message in messages:
        assert "no gradient reached unused.weight, unused.bias this step" in message


def test_accumulating_without_no_sync_is_refused():
    trainer = Trainer(_config(1, "bucketed"), Topology.single())
    x, y = trainer.loader.next_batch()
    trainer.model(x, y).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        trainer.model(x, y).backward()
