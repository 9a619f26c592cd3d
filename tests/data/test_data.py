import functools
from pathlib import Path

import numpy as np
import pytest
import torch

import minitrain
from minitrain import config
from minitrain.config import ConfigError
from minitrain.train.run_config import run_config
from minitrain.data import (
    ByteTokenizer,
    EvalBatches,
    ShardedLoader,
    bin_corpus,
    check_corpus,
    load_corpus,
    load_val,
    make_corpus,
    text_corpus,
)
from minitrain.data import corpus_vocab_size

# The settings as a run reads them: the model's vocabulary from the tokenized corpus unless one is given.
build_config = functools.partial(config.build_config, vocab_of=corpus_vocab_size)


def test_synthetic_corpus_is_deterministic_and_structured():
    a, b = make_corpus(3, 5000, 64), make_corpus(3, 5000, 64)
    assert np.array_equal(a, b) and not np.array_equal(a, make_corpus(4, 5000, 64))
    assert a.min() >= 0 and a.max() < 64
    # Each token has at most three successors: learnable structure, not noise.
    successors = {}
    for x, y in zip(a[:-1], a[1:]):
        successors.setdefault(int(x), set()).add(int(y))
    assert max(len(s) for s in successors.values()) <= 3


def test_text_corpus_round_trips_through_byte_tokenizer():
    tokens = text_corpus()
    assert len(tokens) > 20000 and tokens.max() < 256
    text = ByteTokenizer().decode(tokens)
    assert text.startswith("Field notes") and np.array_equal(ByteTokenizer().encode(text), tokens)


def test_bin_corpus_is_memory_mapped(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    tokens = bin_corpus(path)
    assert isinstance(tokens, np.memmap) and tokens[999] == 999
    loader = ShardedLoader(tokens, seq_len=10, batch_size=2, rank=0, world_size=1, seed=0)
    x, y = loader.next_batch()
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharding_covers_each_example_once_without_overlap(world):
    tokens = make_corpus(0, 16 * 100 + 1)
    loaders = [ShardedLoader(tokens, 16, 4, r, world, seed=5) for r in range(world)]
    per_epoch = loaders[0].batches_per_epoch
    assert all(ld.batches_per_epoch == per_epoch for ld in loaders)  # same number of steps on every rank
    seen = [np.concatenate([ld.rank_examples(0, b) for b in range(per_epoch)]) for ld in loaders]
    everything = np.concatenate(seen)
    assert len(everything) == len(set(everything.tolist())) == per_epoch * 4 * world  # no overlap
    dropped = 100 - len(everything)
    assert 0 <= dropped < 4 * world  # full coverage up to one partial global batch
    # Example i of the epoch order goes to rank i % world.
    order = loaders[0].epoch_order(0)
    for r in range(world):
        assert np.array_equal(seen[r], order[:per_epoch * 4 * world][r::world])


def test_global_batch_is_the_same_whatever_the_world_size():
    tokens = make_corpus(0, 16 * 64 + 1)
    single = ShardedLoader(tokens, 16, 8, 0, 1, seed=1)
    pair = [ShardedLoader(tokens, 16, 4, r, 2, seed=1) for r in range(2)]
    for _ in range(10):  # crosses an epoch boundary (8 batches per epoch)
        x1, _ = single.next_batch()
        x2 = torch.cat([ld.next_batch()[0] for ld in pair])
        assert sorted(map(tuple, x1.tolist())) == sorted(map(tuple, x2.tolist()))


def test_epochs_reshuffle_and_state_resumes_exactly():
    tokens = make_corpus(0, 16 * 40 + 1)
    a = ShardedLoader(tokens, 16, 4, 1, 2, seed=9)
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    for _ in range(7):
        a.next_batch()
    state = a.state_dict()
    b = ShardedLoader(tokens, 16, 4, 1, 2, seed=9)
    b.load_state_dict(state)
    for _ in range(12):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other = ShardedLoader(tokens, 16, 2, 1, 2, seed=9)
    with pytest.raises(ValueError, match="global_batch"):
        other.load_state_dict(state)


def test_check_corpus_explains_what_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="needs model.vocab_size >= 256"):
        check_corpus(build_config(cli_values={"data.corpus": "text", "model.vocab_size": 64}))
    assert build_config(cli_values={"data.corpus": "text"}).model.vocab_size == 256  # the corpus's, unless told
    with pytest.raises(ConfigError, match="bigger corpus or a smaller batch"):
        check_corpus(build_config(cli_values={"data.synthetic_tokens": 100, "dist.nproc": 4}))
    with pytest.raises(ConfigError, match="neither"):
        check_corpus(build_config(cli_values={"data.corpus": str(tmp_path / "missing.bin")}))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="has 0 bytes"):
        check_corpus(build_config(cli_values={"data.corpus": str(empty)}))
    big = tmp_path / "big.bin"
    np.array([0, 300] * 100, dtype=np.uint16).tofile(big)
    with pytest.raises(ConfigError, match="vocab_size >= 301"):
        check_corpus(build_config(cli_values={"data.corpus": str(big)}))


def test_text_is_refused_where_tokens_are_expected(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("an even number of bytes!")  # would read as 12 uint16 "tokens"
    with pytest.raises(ConfigError, match=r"is text, not token ids: tokenize it first with `minitrain data prepare"):
        check_corpus(build_config(cli_values={"data.corpus": str(notes)}))


def test_every_corpus_holds_a_held_out_split_apart_from_its_training_tokens(tmp_path):
    cfg = build_config(cli_values={"data.synthetic_tokens": 5000})
    train, val = load_corpus(cfg), load_val(cfg)
    assert len(val) == 500 and not np.array_equal(train[:500], val)
    assert np.array_equal(train, make_corpus(0, 5000, 64))  # the training walk is what it always was
    # The same chain: every transition of the held-out walk is one of the table's (a long training walk
    # takes all 64 x 3 of them).
    long = make_corpus(0, 100_000, 64)
    table = set(zip(long[:-1].tolist(), long[1:].tolist()))
    assert set(zip(val[:-1].tolist(), val[1:].tolist())) <= table
    text = build_config(cli_values={"data.corpus": "text"})
    whole = np.concatenate([load_corpus(text), load_val(text)])
    assert np.array_equal(whole, ByteTokenizer().encode(
        (Path(minitrain.__file__).parent / "corpora" / "field_notes.txt").read_text()))
    assert len(load_val(text)) == len(whole) // 10 and load_val(text).size > 0
    tokens = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint16).tofile(tokens)
    assert load_val(build_config(cli_values={"data.corpus": str(tokens)})) is None
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "val.bin")  # nanoGPT's layout: val.bin beside train.bin
    assert np.array_equal(load_val(build_config(cli_values={"data.corpus": str(tokens)})), np.arange(50))


def test_evaluation_is_refused_without_a_held_out_split_or_with_too_small_a_one(tmp_path):
    tokens = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(tokens)
    with pytest.raises(ConfigError, match="--eval-every needs a held-out split and corpus .* has none"):
        run_config(cli_values={"data.corpus": str(tokens), "model.vocab_size": 1000, "eval.every": 5})
    with pytest.raises(ConfigError, match="one evaluation batch needs batch_size x data-parallel ranks = 64"):
        run_config(cli_values={"data.synthetic_tokens": 4000, "eval.every": 5, "train.batch_size": 16,
                                 "dist.nproc": 4})


def test_evaluation_batches_split_the_same_examples_over_ranks_every_time():
    tokens = np.arange(16 * 20 + 1, dtype=np.uint16)  # 20 examples of 16 tokens
    per_rank = [list(EvalBatches(tokens, 16, 2, rank, 3, batches=10)) for rank in range(3)]
    assert all(len(batches) == 3 for batches in per_rank)  # 20 // (2 x 3) whole batches, not 10
    starts = sorted(int(x[i, 0]) // 16 for batches in per_rank for x, _ in batches for i in range(2))
    assert starts == list(range(18))  # the first 3 global batches, each example once
    assert [x.tolist() for x, _ in per_rank[1]] == [x.tolist() for x, _ in EvalBatches(tokens, 16, 2, 1, 3, 10)]
