"""The CUDA/NCCL paths, proven on this CPU machine by construction: a model on the `meta` device stands for a
model on a GPU (its tensors live somewhere that is not the host, so anything left on the host, or moved there,
shows), torch.cuda's functions patched to report devices, and init_process_group caught before it connects.

Each test fails on the code before the fix it names (issue: GPU-correct before the first GPU)."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn

import minitrain
from minitrain.checkpoint import files
from minitrain.runtime.comm import CollectiveError, Comm
from minitrain.config import ConfigError
from minitrain.runtime import topology
from minitrain.runtime.topology import Topology

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
CAPTURABLE = functools.partial(torch.optim.AdamW, lr=1e-2, capturable=True)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 11)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def tiny(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return Tiny()


def _step(model, opt, device):
    x = torch.arange(12, device=device).view(2, 6) % 11
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_prepare_keeps_a_model_on_its_own_device():
    """The single-process API moved a CUDA model to the CPU (Topology.single() is the CPU): a model elsewhere stays
    there, and its flat buffers and optimizer state live there too."""
    for zero in range(4):
        model, opt = minitrain.prepare(tiny("meta"), ADAMW, zero=zero)
        assert {p.device.type for p in model.parameters()} == {"meta"}, zero
        strategy = minitrain.api.session.state_of(model).strategy
        assert strategy.optimizer.master.device.type == "meta" and strategy.comm.device.type == "meta", zero


def test_a_checkpoint_loads_onto_the_device_its_model_lives_on(tmp_path, monkeypatch):
    """A checkpoint is read on the host. At ZeRO-1/2 the host shard went into the parameters' all_gather as it
    was (NCCL refuses a CPU tensor), and the optimizer state stayed on the host, so the first step after a resume
    mixed devices. Now every tensor handed to a collective lives on the group's device, and the state goes where
    its parameter is (a capturable optimizer's step too; a plain one's step stays on the host, as torch keeps it)."""
    handed = []
    original = Comm.all_gather

    def spy(self, full_out, shard_in):
        handed.append((full_out.device, shard_in.device))
        return original(self, full_out, shard_in)

    monkeypatch.setattr(Comm, "all_gather", spy)
    for zero in range(4):
        model, opt = minitrain.prepare(tiny(), ADAMW, zero=zero)
        _step(model, opt, "cpu")
        minitrain.save_checkpoint(tmp_path / str(zero), model, opt, 1)
        for optimizer, step_device in ((ADAMW, "cpu"), (CAPTURABLE, "meta")):
            meta, meta_opt = minitrain.prepare(tiny("meta"), optimizer, zero=zero)
            handed.clear()
            minitrain.load_checkpoint(tmp_path / str(zero), meta, meta_opt)
            assert all(out == inp for out, inp in handed), (zero, handed)
            for state in meta_opt.inner.state.values():
                assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta", zero
                assert state["step"].device.type == step_device, (zero, optimizer)
            if optimizer is ADAMW:  # the user's optimizer steps with its restored state (capturable kernels
                for group in meta_opt.param_groups:  # refuse meta tensors; the plain ones run)
                    for view in group["params"]:
                        view.grad = torch.zeros_like(view)
                meta_opt.inner.step()


def test_a_collective_refuses_a_tensor_off_its_device():
    comm = Comm(device="meta")
    with pytest.raises(CollectiveError, match="a cpu tensor was handed to a collective of the world group"):
        comm.all_gather(torch.empty(4, device="meta"), torch.zeros(4))


def test_capturable_optimizers_are_accepted_under_zero():
    """Refused before: the elementwise probe ran them on host tensors, which capturable=True does not allow."""
    for zero in (1, 2, 3):
        minitrain.prepare(tiny("meta"), CAPTURABLE, zero=zero)


def _cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_each_rank_gets_its_local_ranks_gpu_or_a_refusal(monkeypatch):
    _cuda(monkeypatch, 2)
    assert topology.resolve_backend("auto") == "nccl"
    assert topology.local_device("nccl", 1, 2) == torch.device("cuda", 1)
    assert topology.local_device("gloo", 1, 2) == torch.device("cpu")
    _cuda(monkeypatch, 1)  # a node with fewer GPUs than ranks: refused, not quietly run on gloo
    assert topology.resolve_backend("auto") == "nccl"
    with pytest.raises(ConfigError, match="2 rank\\(s\\) on this node but 1 GPU\\(s\\)"):
        topology.local_device("nccl", 1, 2)
    _cuda(monkeypatch, 0)
    assert topology.resolve_backend("auto") == "gloo"


class _Joined(Exception):
    pass


def test_joining_binds_each_rank_to_its_gpu(monkeypatch):
    """Under torchrun with NCCL, the device is set from LOCAL_RANK before anything runs on it, and the process
    group is bound to it (device_id), so no rank defaults to GPU 0."""
    _cuda(monkeypatch, 4)
    chosen, joined = [], {}
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)

    def init_process_group(backend, **kwargs):
        joined.update(kwargs, backend=backend)
        raise _Joined

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr("minitrain.runtime.topology._rendezvous_store", lambda *a: None)
    for key, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(_Joined):
        Topology.from_env("nccl")
    assert chosen == [torch.device("cuda", 3)]
    assert joined["backend"] == "nccl" and joined["device_id"] == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="8 rank\\(s\\) on this node but 4 GPU\\(s\\)"):
        Topology.from_env("auto")


def test_cuda_generators_are_saved_and_restored(monkeypatch):
    """Dropout on a GPU draws from the CUDA generators: a resume now continues them like the CPU one."""
    states = [torch.full((16,), 7, dtype=torch.uint8), torch.full((16,), 9, dtype=torch.uint8)]
    restored = []
    _cuda(monkeypatch, 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    saved = files.rng_state()
    assert torch.equal(saved["rng.cuda"], torch.stack(states))
    files.set_rng_state(saved)
    assert [s.tolist() for s in restored] == [s.tolist() for s in states]


def test_a_checkpoint_with_cuda_generators_round_trips(tmp_path, monkeypatch):
    states = [torch.arange(16, dtype=torch.uint8)]
    restored = []
    _cuda(monkeypatch, 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    model, opt = minitrain.prepare(tiny(), ADAMW, zero=1)
    minitrain.save_checkpoint(tmp_path, model, opt, 1)
    again, again_opt = minitrain.prepare(tiny(), ADAMW, zero=1)
    minitrain.load_checkpoint(tmp_path, again, again_opt)
    assert [s.tolist() for s in restored] == [s.tolist() for s in states]


# --- figures that would be wrong on NCCL, with fake Works that complete later than they return ------------------
class FakeEvent:
    """A device mark: done once the device has a time for it."""

    def __init__(self, time=None):
        self.time = time


class FakeClock:
    """A device clock (clock.py's interface) driven by the test: mark() stamps the device's time `now`."""
    on_device = True

    def __init__(self):
        self.now = 0.0

    def mark(self):
        return FakeEvent(self.now)

    def mark_done(self, work):
        return work.done_event

    def ready(self, mark):
        return mark.time is not None

    def wait(self, mark):
        assert mark.time is not None, "waited for a mark the device never reaches: it would hang"

    def seconds(self, mark):
        return mark.time


class FakeWork:
    """An NCCL collective: wait() returns at once (it only orders the stream), the future is complete when
    queued, and the device finishes it later (finish)."""

    def __init__(self):
        self.done_event = FakeEvent()

    def wait(self):
        return True

    def is_completed(self):
        return self.done_event.time is not None

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future

    def finish(self, at: float):
        self.done_event.time = at


def _device_comm():
    comm = Comm(rank=0, world_size=2, device="cpu", name="dp")
    comm.clock = FakeClock()
    return comm


def test_a_collective_is_timed_on_the_device_not_at_enqueue():
    """comm_ms was booked when the host passed the collective: about nothing on NCCL. Now the device's marks
    are booked once they are done (after the step's host synchronisation)."""
    comm = _device_comm()
    work = FakeWork()
    pending = comm._launch("all_reduce", 64, lambda: work)
    assert not pending.done()  # NCCL's future says done at once; the device does not
    launched, completed = pending.wait()  # returns at once, as on NCCL
    assert comm.totals().seconds == 0.0 and comm.totals().calls == 0  # not done on the device: not booked yet
    comm.clock.now = 0.3
    work.finish(at=0.5)
    assert pending.done() and comm.totals().calls == 1 and comm.totals().seconds == pytest.approx(0.5)


def test_the_gradient_sync_overlap_is_read_from_device_marks():
    comm = _device_comm()
    model, _ = minitrain.prepare(tiny(), ADAMW, zero=0)
    strategy = minitrain.api.session.state_of(model).strategy
    strategy.comm = comm
    first, second, end = FakeEvent(0.0), FakeEvent(), FakeEvent(0.6)
    strategy.sync_at(2, [(first, FakeEvent(0.4)), (FakeEvent(0.2), second)], end)
    assert strategy.last_sync == {}  # not read before the device is done
    second.time = 1.0
    sync = strategy.last_sync
    assert sync["allreduce_calls"] == 2 and sync["allreduce_inflight_s"] == pytest.approx(1.0)
    assert sync["overlap"] == pytest.approx(0.6)  # 0.6 s of the 1.0 s in flight before backward ended


def test_the_watch_sees_a_collective_the_device_has_not_finished():
    """On NCCL the host leaves a collective at once: the watch counted the rank as out of it, and a hang in it
    went unseen. It now watches the Work until the device finishes it."""
    from minitrain.runtime.watch import CollectiveWatch

    watch = CollectiveWatch(0, 1, torch.distributed.HashStore(), 0.05, report=lambda *a: None)
    try:
        work = FakeWork()
        fp = ("dp", 1, "all_reduce", ((4,),), "float32", "test.py:1")
        watch.outstanding(fp, work.is_completed)
        assert watch._in_collective()[0] == fp
        import time

        time.sleep(0.1)
        assert "stuck" in (watch._due() or "")
        work.finish(at=1.0)
        assert watch._in_collective() is None and watch._due() is None
    finally:
        watch.close()


def test_the_pipeline_times_its_actions_with_the_device_clock():
    """Its bubble was host time after a synchronisation per action; now it is read from the clock's marks
    without any synchronisation (here every mark is one device second after the last)."""
    from minitrain.parallel.pipeline_parallel.executor import Pipeline

    comm = Comm(device="cpu", name="pp")
    comm.clock = TickingClock()
    stage = nn.Linear(4, 4).double()
    pipeline = Pipeline(lambda x, y: stage(x).square().mean() if y is not None else stage(x), comm, "1f1b", 2, 4,
                        torch.float64, torch.device("cpu"), forward_context=contextlib.nullcontext,
                        no_sync=contextlib.nullcontext)
    pipeline.run(torch.randn(4, 4, dtype=torch.float64), torch.zeros(4), 1.0, sync=True)
    # marks: start, then per action (F0, F1, B0, B1 for M=2 on one stage) began and ended, then the end
    assert pipeline.measured["span_s"] == 9.0 and pipeline.measured["busy_s"] == 4.0


class TickingClock(FakeClock):
    def mark(self):
        self.now += 1.0
        return FakeEvent(self.now)


def test_busy_time_on_a_device_comes_from_its_events():
    """Per-rank busy time (the straggler report) was host time less host waits: on a GPU, the time to enqueue.
    With a device clock the row carries the step before's device time in its phases but comm."""
    from minitrain.train.run_config import run_config
    from minitrain.train.trainer import Trainer

    cfg = run_config(cli_values={"model.preset": "tiny", "train.log_every": 0})
    trainer = Trainer(cfg, Topology.single())
    trainer.topo.dp.clock = FakeClock()  # the device path, with host-timed phases
    first = trainer.train_step()
    second = trainer.train_step()
    assert first.busy_s_per_rank == [0.0]  # nothing measured before the first step
    phases = first.phases_s
    expected = sum(phases[k] or 0.0 for k in ("data", "forward", "backward", "forward_backward", "optimizer"))
    assert second.busy_s_per_rank == [pytest.approx(expected)]


def test_a_snapshot_makes_no_second_copy_of_the_state_where_it_lives(tmp_path, monkeypatch):
    """An async save copied the parameters into a new tensor where they live (torch.cat of the shard ranges, a
    clone at ZeRO-3) before moving them to the host; now the pieces go straight into host memory."""
    from minitrain.checkpoint.writing import ShardWrite

    for zero in range(4):
        model, opt = minitrain.prepare(tiny(), ADAMW, zero=zero)
        _step(model, opt, "cpu")
        state = minitrain.api.session.state_of(model)
        made = []
        monkeypatch.setattr(torch, "cat", lambda *a, **k: made.append("cat") or torch.stack([]))
        monkeypatch.setattr(torch.Tensor, "clone", lambda *a, **k: made.append("clone"))
        try:
            job = ShardWrite(tmp_path, 1, state.topo, state.strategy, {}, {}, copy=True)
        finally:
            monkeypatch.undo()
        assert made == [], zero
        assert torch.equal(job.shards["params"], state.strategy.local_params()), zero


def test_a_gpus_norm_sums_squares_in_float64_without_a_copy_and_agrees_with_the_float64_copies(monkeypatch):
    """On a GPU SquareSums takes each chunk's sum of squares by one compiled kernel that upcasts as it reads (no
    float64 copy, no cuBLAS dot: 1.8 ms of a gpt2-124m step on an H100). The same sums as the CPU's copies to
    float64 summation's error (the two sum in other orders), chunk by chunk, over a vector of several chunks and a
    tail, narrow and full; where torch.compile cannot run, the eager form with a warning that says so."""
    from minitrain.parallel.core import norms

    monkeypatch.setattr(norms, "_compiled_square_sum", None)
    # Traced by dynamo as on a GPU, its graph run eagerly: inductor's CPU code would take seconds to build and is
    # not what a GPU runs (Triton); the GPU's kernel is what tests/system/test_gpu.py and benchmarks/gpu.py run there.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.manual_seed(0)
    chunk = norms.SquareSums.CHUNK
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(3 * chunk + 777) * 3).to(dtype)
        copied, upcast = norms.SquareSums().block_dots(x), norms.upcasting_square_sums(x, chunk)
        assert len(copied) == len(upcast) == 4 and all(d.dtype == torch.float64 for d in upcast)
        for a, b in zip(copied, upcast):
            assert abs(float(a) - float(b)) <= 1e-12 * float(a), (dtype, float(a), float(b))
        exact = float(x.double().square().sum())
        assert abs(float(norms.sum_in_order(upcast, x.device)) - exact) <= 1e-12 * exact
    assert norms._compiled_square_sum is not False  # compiled, not the fallback

    def no_compiler(fn, **kwargs):
        def fails(*args):
            raise RuntimeError("no Triton here")
        return fails

    monkeypatch.setattr(norms, "_compiled_square_sum", None)
    monkeypatch.setattr(torch, "compile", no_compiler)
    x = torch.randn(1000)
    with pytest.warns(UserWarning, match="torch.compile failed .*no Triton here.*run eagerly"):
        [eager] = norms.upcasting_square_sums(x, chunk)
    assert eager.dtype == torch.float64 and abs(float(eager) - float(x.double().square().sum())) <= 1e-12 * float(eager)
    assert norms._compiled_square_sum is False
