"""Every way of splitting 4 ranks into data x tensor x pipeline parallel, with ZeRO 0 and 1, trains
exactly like one process (float64, 10 steps): the parity matrix of `parallelize`."""
import pytest

from minitrain.config import build_config
from minitrain.topology import Topology
from minitrain.trainer import Trainer

from .dist import run_ranks

TOL = 1e-12
STEPS = 10
GLOBAL_BATCH = 8
LAYOUTS = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)]  # (dp, tp, pp)
MODEL = {"model.n_layer": 4, "model.d_model": 32, "model.n_head": 4, "model.vocab_size": 64}


def _config(dp, tp, pp, zero):
    return build_config(cli_values={
        "train.dtype": "float64", "train.zero": zero, "train.steps": STEPS, "train.log_every": 0,
        "dist.nproc": dp * tp * pp, "dist.tp": tp, "dist.pp": pp, "train.batch_size": GLOBAL_BATCH // dp,
        # Pipelines get 4 micro-batches per batch (GPipe for 2 stages, 1F1B for 4; both are tested alone too).
        "dist.microbatches": 4 if pp > 1 else 1, "dist.schedule": "gpipe" if pp == 2 else "1f1b",
        **MODEL}).validate()


def _matrix(topo):
    """Every layout and ZeRO stage in turn on the same 4 ranks: each rank's losses and global norms."""
    out = {}
    for dp, tp, pp in LAYOUTS:
        for zero in (0, 1):
            trainer = Trainer(_config(dp, tp, pp, zero), topo.with_layout(tp, pp))
            records = [trainer.train_step() for _ in range(STEPS)]
            out[(dp, tp, pp, zero)] = [(r.loss, r.grad_norm, r.param_norm) for r in records]
    return out


def test_every_layout_with_zero_0_and_1_trains_like_one_process():
    trainer = Trainer(_config(1, 1, 1, 0), Topology.single())
    reference = [(r.loss, r.grad_norm, r.param_norm) for r in (trainer.train_step() for _ in range(STEPS))]
    assert reference[-1][0] < reference[0][0]
    per_rank = run_ranks(_matrix, 4, timeout_s=240)
    failures = []
    for key in per_rank[0]:
        worst = max(abs(a - b) for rank in per_rank for step, ref in zip(rank[key], reference)
                    for a, b in zip(step, ref))
        if not worst <= TOL:
            failures.append(f"(dp, tp, pp, zero) = {key}: off by {worst:.3g}")
    assert not failures, "\n".join(failures)
