"""Loss-spike rollback, background saves and the restored data order, in one process
(the multi-rank scenarios are in tests/system/test_fault_tolerance.py)."""
import math
import threading

import pytest
import torch

from minitrain import checkpoint
from minitrain.train.run_config import run_config
from minitrain.data import ShardedLoader, make_corpus
from minitrain.parallel.core.sync_stats import same_state
from minitrain.train.guards import SpikeError, SpikeGuard
from minitrain.train.loop import TrainingRun
from minitrain.runtime.topology import Topology
from minitrain.train.trainer import Trainer


def _config(out, **values):
    base = {"train.steps": 20, "ckpt.every_steps": 5, "train.log_every": 0, "out": str(out)}
    return run_config(cli_values={**base, **values})


def _run(out, **values):
    run = TrainingRun(Topology.single(), _config(out, **values))
    return run, run.run()


def test_spike_guard_compares_with_the_mean_of_a_full_window():
    guard = SpikeGuard(factor=2.0, window=3)
    assert guard.check(1.0) is None and guard.check(100.0) is None  # window not full yet: no verdict
    guard = SpikeGuard(2.0, 3, history=[3.0, 3.0, 3.0])
    assert guard.check(6.0) is None  # not above 2 x 3
    assert guard.check(float("nan")) is None and guard.state() == [3.0, 3.0, 6.0]  # NaN: the NaN guard's business
    assert guard.check(100.0) == pytest.approx(4.0) and guard.state() == [3.0, 3.0, 6.0]  # a spike stays out
    assert SpikeGuard(0.0, 3, history=[1.0, 1.0, 1.0]).check(1e9) is None  # factor 0: off


def test_loss_spike_rolls_back_to_the_last_checkpoint_and_the_run_ends_as_if_it_never_happened(tmp_path, capsys):
    clean, _ = _run(tmp_path / "clean")
    # Step 12's learning rate is multiplied by 1000: step 13's loss spikes. The step-12 checkpoint
    # does not exist (every 5), and the newest before the bad update is step 10.
    spiked, summary = _run(tmp_path / "spiked", **{"fault.kind": "lr-spike", "fault.step": 12,
                                                    "fault.lr_multiplier": 1000.0})
    [event] = summary["rollbacks"]
    assert event["spike_step"] == 13 and event["to_step"] == 10 and event["loss"] > 2 * event["running_mean"]
    assert "loss spike at step 13" in capsys.readouterr().out
    assert summary["steps"] == 20 and math.isfinite(summary["final_loss"])
    # The replay saw the same data and random streams without the bad learning rate: bit-identical.
    assert same_state(spiked.trainer.strategy.state_snapshot(), clean.trainer.strategy.state_snapshot())
    metrics = (tmp_path / "spiked" / "metrics.jsonl").read_text().splitlines()
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in metrics]
    assert steps == list(range(1, 11)) + [10] + list(range(11, 21))  # the rollback event, then 11.. redone once


def test_a_spike_that_comes_back_after_rolling_back_stops_the_run(tmp_path):
    run = TrainingRun(Topology.single(), _config(tmp_path))
    t = run.trainer
    # Logits x 50 whenever step 13 runs: the replay spikes again, so the spike is not transient.
    t.model.head.register_forward_hook(lambda _m, _a, out: out * 50.0 if t.step + 1 == 13 else out)
    with pytest.raises(SpikeError, match="again after rolling back to step 10: the spike is reproducible"):
        run.run()


def test_a_spike_with_no_checkpoint_to_return_to_is_reported_and_training_goes_on(tmp_path, capsys):
    _, summary = _run(tmp_path, **{"ckpt.every_steps": 0, "fault.kind": "lr-spike", "fault.step": 12,
                                   "fault.lr_multiplier": 1000.0})
    assert summary["steps"] == 20 and not summary["rollbacks"]
    assert "no checkpoint before step 12 to roll back to (set --ckpt-every-steps), continuing" in capsys.readouterr().err


def test_background_save_holds_the_snapshot_and_moves_latest_only_once_durable(tmp_path, monkeypatch):
    trainer = Trainer(_config(tmp_path), Topology.single())
    root = tmp_path / "checkpoints"
    trainer.train_step()
    first = trainer.save_checkpoint(root)
    trainer.train_step()
    at_save = {k: torch.cat([p.detach().reshape(-1) for p in v]) for k, v in trainer.strategy.state_pieces().items()}

    release, real_save_file = threading.Event(), checkpoint.writing.save_file
    monkeypatch.setattr(checkpoint.writing, "save_file", lambda *a, **k: (release.wait(30), real_save_file(*a, **k)))
    pending = trainer.start_async_save(root)
    trainer.train_step()  # training goes on while the write is held back...
    trainer.train_step()
    assert not pending.written and (root / "latest").read_text().strip() == first.name  # ...and latest stays
    release.set()
    path = pending.commit()
    assert (root / "latest").read_text().strip() == path.name == "step-000002"
    _, manifest = checkpoint.verify(path)
    saved = checkpoint.assemble_flat(path, manifest)
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save)  # what was there at the save, not after


def _record_batches(trainer, steps):
    seen, real = [], trainer.loader.next_batch

    def spy():
        x, y = real()
        seen.append(x.clone())
        return x, y

    trainer.loader.next_batch = spy
    for _ in range(steps):
        trainer.train_step()
    return seen


def test_restored_loader_yields_exactly_the_uninterrupted_batches(tmp_path):
    cfg = _config(tmp_path, **{"train.grad_accum": 2, "data.synthetic_tokens": 16 * 100 + 1})  # 25 batches/epoch
    uninterrupted = Trainer(cfg, Topology.single())
    _record_batches(uninterrupted, 3)
    path = uninterrupted.save_checkpoint(tmp_path / "checkpoints")
    expected = _record_batches(uninterrupted, 30)  # 60 micro-batches: two epoch boundaries

    resumed = Trainer(cfg, Topology.single())
    resumed.load_checkpoint(path)
    got = _record_batches(resumed, 30)
    assert len(got) == 60 and all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("world_after", [1, 4])
def test_loader_state_from_two_ranks_continues_at_another_world_size(world_after):
    tokens = make_corpus(0, 16 * 64 + 1)
    before = [ShardedLoader(tokens, 16, 4, rank, 2, seed=3) for rank in range(2)]
    for _ in range(5):
        for loader in before:
            loader.next_batch()
    state = before[0].state_dict()
    after = [ShardedLoader(tokens, 16, 8 // world_after, rank, world_after, seed=3) for rank in range(world_after)]
    for loader in after:
        loader.load_state_dict(state)
    for _ in range(6):  # the same global batches, split another way
        want = torch.cat([ld.next_batch()[0] for ld in before])
        got = torch.cat([ld.next_batch()[0] for ld in after])
        assert sorted(map(tuple, want.tolist())) == sorted(map(tuple, got.tolist()))


def test_a_fault_plan_fires_each_process_fault_once_across_restarts_and_a_bad_batch_at_every_run(tmp_path):
    import errno

    from minitrain.config import ConfigError, FaultConfig
    from minitrain.config.faults import Fault, planned_faults
    from minitrain.train.faults import Faults

    cfg = FaultConfig(plan="lr-spike@12,nan@7:1,disk-full@10:1", lr_multiplier=1000.0, ledger=str(tmp_path / "ledger"))
    assert planned_faults(cfg) == [Fault("lr-spike", 12, 0), Fault("nan", 7, 1), Fault("disk-full", 10, 1)]
    with pytest.raises(ConfigError, match="'nan@x'"):
        planned_faults(FaultConfig(plan="nan@x"))
    first, restarted = Faults(cfg, rank=1, resumed=False), Faults(cfg, rank=1, resumed=True)
    assert first.lr_factor(12) == 1000.0 and restarted.lr_factor(12) == 1.0  # the ledger: once across processes
    with pytest.raises(OSError) as full:
        first.after_shard_written(10)
    assert full.value.errno == errno.ENOSPC
    restarted.after_shard_written(10)  # fired already: the restarted run's save goes through
    assert sorted(p.name for p in (tmp_path / "ledger").iterdir()) == ["disk-full@10:1", "lr-spike@12:1"]
    restarted.on_resume()
    assert math.isnan(restarted.loss_factor(7)) and math.isnan(restarted.loss_factor(7))  # every run of its step
    assert Faults(cfg, rank=0, resumed=False).loss_factor(7) == 1.0  # another rank's batch
    # Without a ledger a process fault never fires in a resumed run, and fires once in a fresh one.
    plain = FaultConfig(kind="lr-spike", step=12, lr_multiplier=1000.0)
    fresh = Faults(plain, rank=0, resumed=False)
    assert [fresh.lr_factor(12), fresh.lr_factor(12)] == [1000.0, 1.0]
    assert Faults(plain, rank=0, resumed=True).lr_factor(12) == 1.0
