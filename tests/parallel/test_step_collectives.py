"""What one training step sends, per strategy: the collectives, how many and how many bytes, pinned
exactly, and how often it reads a tensor's values on the host. An added collective, a gather done twice,
a gradient reduced in the wrong dtype or a stray `.item()` fails here, deterministically, instead of
slowing every step of every run a little. (On a GPU every such read makes the host wait for the device.)

Counted by the comm layer (every collective goes through `Comm._run`) over one steady-state step (the
second) at 2 ranks in float32. P = parameters (padded to a multiple of the ranks at ZeRO 1-3), U = ZeRO
units (one per block, plus the embeddings, final norm and head), T = parameter tensors."""
import pytest
from torch.overrides import TorchFunctionMode


from minitrain import plan
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_ranks

STRATEGIES = [("bucketed", 0), ("naive", 0), ("torch", 0), ("bucketed", 1), ("bucketed", 2), ("bucketed", 3)]


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host (each a device sync on a GPU)."""

    READS = frozenset({"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"})

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _one_step(topo):
    out = {}
    for mode, zero in STRATEGIES:
        cfg = run_config(cli_values={"dist.nproc": topo.world_size, "train.zero": zero, "ddp.mode": mode,
                                       "train.log_every": 0})
        trainer = Trainer(cfg, topo)
        trainer.train_step()  # the first step allocates and warms up; the second is what every step costs
        before = {op: (s.calls, s.bytes) for op, s in topo.dp.stats.items()}
        with HostReads() as reads:
            trainer.train_step()
        after = {op: (s.calls, s.bytes) for op, s in topo.dp.stats.items()}
        flat = trainer.strategy.flat
        out[(mode, zero)] = {
            "ops": {op: (calls - before.get(op, (0, 0))[0], sent - before.get(op, (0, 0))[1])
                    for op, (calls, sent) in after.items() if (calls, sent) != before.get(op)},
            "P": flat.padded_numel, "U": len(flat.units), "T": len(flat.segments),
            "buckets": len(getattr(trainer.strategy, "buckets", [])), "host_reads": reads.calls}
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_one_step, 2)[0]


def _expected(mode, zero, P, U, T, buckets):
    """{op: (calls, bytes)} of one step, the per-step statistics exchange left out (checked below)."""
    grads = 4 * P  # float32 gradients, and parameters, of the whole model
    norm = 16  # two float64 partial sums of squares (tensor-parallel slices, the rest)
    if zero == 0:
        calls = {"bucketed": buckets, "naive": T, "torch": 1}[mode]  # torch: DDP's hook, one bucket here
        return {"all_reduce": (calls, grads)}
    if zero == 1:  # data parallel's overlapped bucket all-reduces, then one unit (the whole model) gathered
        return {"all_reduce": (buckets + 1, grads + norm), "all_gather": (1, grads)}
    if zero == 2:
        return {"reduce_scatter": (U, grads), "all_reduce": (1, norm), "all_gather": (U, grads)}
    # ZeRO-3: every unit gathered for forward and again for backward; the parameter norm is a collective too.
    return {"reduce_scatter": (U, grads), "all_reduce": (2, 2 * norm), "all_gather": (2 * U, 2 * grads)}


@pytest.mark.parametrize("mode,zero", STRATEGIES)
def test_one_step_sends_exactly_these_collectives(measured, mode, zero):
    # Besides its gradients, every strategy gathers every rank's step statistics (loss, norms, memory, stop
    # flags) once: data parallel gathers nothing else, so its one all_gather is that, a few hundred bytes.
    stats = measured[("bucketed", 0)]["ops"]["all_gather"]
    assert stats[0] == 1 and stats[1] < 1024
    facts = {k: measured[(mode, zero)][k] for k in ("P", "U", "T", "buckets")}
    expected = _expected(mode, zero, **facts)
    calls, sent = expected.get("all_gather", (0, 0))
    expected["all_gather"] = (calls + stats[0], sent + stats[1])
    assert measured[(mode, zero)]["ops"] == expected, facts


def test_the_model_is_big_enough_to_mean_something(measured):
    facts = measured[("bucketed", 3)]
    assert facts["U"] >= 4 and facts["T"] > facts["U"] and measured[("bucketed", 0)]["buckets"] == 1


@pytest.mark.parametrize("mode,zero", STRATEGIES)
def test_one_step_reads_device_values_once(measured, mode, zero):
    # Only the statistics exchange: its rows (the gradient norm among them) come to the host once and are
    # read there as Python lists. Clipping and skipping a non-finite step happen on the device.
    assert measured[(mode, zero)]["host_reads"] == ["cpu", "tolist"]


def _accumulated_step(topo):
    """ZeRO-2 over 2 micro-batches, in float32 (blocks freed after each backward: gathered again by the next
    forward) and in bf16 (the flat layout: gathered once, after the update)."""
    out = {}
    for precision in ("fp32", "bf16"):
        cfg = run_config(cli_values={"dist.nproc": topo.world_size, "train.zero": 2, "train.grad_accum": 2,
                                     "train.precision": precision, "train.log_every": 0})
        trainer = Trainer(cfg, topo)
        trainer.train_step()
        before = {op: s.calls for op, s in topo.dp.stats.items()}
        trainer.train_step()
        calls = {op: s.calls - before.get(op, 0) for op, s in topo.dp.stats.items()}
        out[precision] = {"calls": calls, "units": len(trainer.strategy.flat.units), "model": cfg.model,
                          "strategy": type(trainer.strategy).__name__}
    return out


def test_zero2_gathers_as_the_planner_counts_with_accumulation():
    for precision, got in run_ranks(_accumulated_step, 2)[0].items():
        rows = {row["what"]: row for row in plan.communication(plan.PlanInput(
            model=got["model"], params=plan.model_params(got["model"]), zero=2, dp=2, grad_accum=2,
            precision=precision))}
        gathers = 2 if precision == "fp32" else 1  # per unit and step: after the update, and before micro-batch 2
        assert got["strategy"] == ("ShardedUnits" if precision == "fp32" else "Zero2"), got
        # (the step statistics' all_gather besides)
        assert got["calls"]["all_gather"] == gathers * got["units"] + 1, got
        assert got["calls"]["reduce_scatter"] == 2 * got["units"], got
        assert rows["all_gather parameters"]["calls"] == gathers * got["units"], rows
        assert rows["reduce_scatter gradients"]["calls"] == 2 * got["units"], rows
