"""Batches made ahead (utils/prefetch.py): the same batches in the same order as made on the spot, across epochs and
after a resume; a source's error raised where it happened; the thread stopped by close or by dropping; the
step's wait for data hidden behind its compute; and a run bit-identical with and without prefetch."""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch

import minitrain
from minitrain.data import ShardedLoader, make_corpus
from minitrain.utils.prefetch import Prefetcher
from minitrain.runtime.topology import Topology
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer


def _prefetch_threads(besides: frozenset = frozenset()) -> int:
    """Prefetch threads alive, not counting those in `besides` (other tests' trainers may hold theirs)."""
    return sum(t.name == "minitrain-prefetch" and t not in besides for t in threading.enumerate())


def _threads_now() -> frozenset:
    return frozenset(threading.enumerate())


def _wait_until(condition, seconds: float = 2.0) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_prefetched_batches_are_the_same_across_epochs_and_after_a_resume():
    before = _threads_now()
    tokens = make_corpus(0, 16 * 40 + 1)
    plain = ShardedLoader(tokens, 16, 4, 1, 2, seed=9)
    ahead = ShardedLoader(tokens, 16, 4, 1, 2, seed=9, prefetch=3)
    assert plain.batches_per_epoch == 5  # 25 batches: five epochs, each reshuffled
    for _ in range(25):
        (xa, ya), (xb, yb) = plain.next_batch(), ahead.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert ahead.state_dict() == plain.state_dict()  # its position is what was taken, not what was made
    # Rewound to an earlier position (a resume, a spike's rollback): what the thread made ahead is dropped.
    rewind = ShardedLoader(tokens, 16, 4, 1, 2, seed=9)
    for _ in range(7):
        rewind.next_batch()
    ahead.load_state_dict(rewind.state_dict())
    for _ in range(12):
        (xa, ya), (xb, yb) = rewind.next_batch(), ahead.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    ahead.close()
    assert _prefetch_threads(before) == 0


def test_a_source_error_is_raised_at_its_batch_and_the_thread_ends():
    def source():
        yield 0
        yield 1
        raise KeyError("batch 2 is unreadable")

    before, got = _threads_now(), []
    with pytest.raises(KeyError, match="batch 2 is unreadable"), Prefetcher(source(), depth=4) as batches:
        for b in batches:
            got.append(b)
    assert got == [0, 1]  # the batches before it, each once
    assert _prefetch_threads(before) == 0
    with pytest.raises(ValueError, match="depth >= 1"):
        Prefetcher(iter([]), depth=0)


def test_close_or_dropping_stops_the_thread():
    before, made = _threads_now(), []

    def counted():
        for i in range(1000):
            made.append(i)
            yield torch.full((2,), i)

    p = Prefetcher(counted(), depth=2)
    assert torch.equal(next(p), torch.zeros(2, dtype=torch.int64))
    assert _wait_until(lambda: len(made) >= 3)
    time.sleep(0.05)
    assert len(made) <= 4  # bounded: the taken one, `depth` queued, one waiting for room
    p.close()
    assert _prefetch_threads(before) == 0 and next(p, None) is None
    dropped = Prefetcher(counted(), depth=2)
    next(dropped)
    del dropped
    gc.collect()
    assert _wait_until(lambda: _prefetch_threads(before) == 0)


def test_structured_batches_are_moved_to_the_device():
    batches = [{"input_ids": torch.arange(4), "labels": (torch.ones(2), "kept")}]
    with minitrain.Prefetcher(batches, device="cpu") as ahead:
        (got,) = list(ahead)
    assert torch.equal(got["input_ids"], torch.arange(4)) and got["labels"][1] == "kept"


def test_the_wait_for_a_slow_source_hides_behind_the_step():
    """A source that takes 40 ms a batch and a step that computes 60 ms: made on the spot, the step waits the
    40 ms every time; made ahead, only for the first batch."""
    def slow_source():
        for i in range(8):
            time.sleep(0.04)  # like a tokenizer in native code: the GIL is released
            yield i

    def waits(batches) -> list[float]:
        out = []
        while True:
            start = time.perf_counter()
            if next(batches, None) is None:
                return out
            out.append(time.perf_counter() - start)
            time.sleep(0.06)  # the step's compute

    on_the_spot = waits(slow_source())
    with Prefetcher(slow_source(), depth=2) as ahead:
        made_ahead = waits(ahead)
    assert len(on_the_spot) == len(made_ahead) == 8
    assert min(on_the_spot) >= 0.04
    assert sum(made_ahead[1:]) < 0.25 * sum(on_the_spot[1:]), (made_ahead, on_the_spot)


@pytest.mark.parametrize("zero", [0, 3])
def test_a_run_is_bit_identical_with_and_without_prefetch(tmp_path, zero):
    """Trained 4 steps, saved, 3 more; then resumed from the save: every loss and every final parameter equal
    whether batches are made ahead or on the spot."""
    saved = []

    def run(prefetch: int, resume: bool):
        cfg = run_config(cli_values={"train.zero": zero, "train.steps": 7, "train.log_every": 0,
                                     "data.prefetch": prefetch, "train.dtype": "float64"})
        with Trainer(cfg, Topology.single()) as trainer:
            losses = []
            if resume:
                trainer.load_checkpoint(saved[0])
            else:
                losses = [trainer.train_step().loss for _ in range(4)]
                if prefetch == 0:
                    saved.append(trainer.save_checkpoint(tmp_path / "saved"))
            losses += [trainer.train_step().loss for _ in range(3)]
            return losses, trainer.strategy.state_snapshot()  # parameters and optimizer state

    plain_losses, plain_params = run(0, resume=False)
    ahead_losses, ahead_params = run(2, resume=False)
    resumed_losses, resumed_params = run(2, resume=True)
    assert ahead_losses == plain_losses and resumed_losses == plain_losses[4:]
    for key, value in plain_params.items():
        assert torch.equal(value, ahead_params[key]) and torch.equal(value, resumed_params[key]), key
    assert np.isfinite(plain_losses).all()
