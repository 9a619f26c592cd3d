"""TokenShards: sharded corpora on disk and in a store (moto's S3), the same global batches at any world size,
mid-epoch resume without replay, a bounded cache, and the faults a store and a disk bring."""
import errno

import numpy as np
import pytest
import torch

from minitrain.corpus import store as store_module
from minitrain.corpus.shard_cache import ShardCache
from minitrain.corpus.store import CorpusStore, DataError
from minitrain.corpus.token_shards import TokenShards, load_index
from tests.helpers.s3_server import s3_server
from tests.helpers.shards import write_corpus

SHARDS = [300, 500, 200, 410, 333, 120, 260]  # uneven on purpose: blocks of unequal sizes
T = 16


def _windows(loader, batches):
    return [loader.next_batch() for _ in range(batches)]


@pytest.mark.parametrize("world", [2, 4])
def test_the_global_batch_is_the_same_at_any_world_size(tmp_path, world):
    write_corpus(tmp_path, SHARDS)
    one = TokenShards(str(tmp_path), T, 8, seed=3, prefetch=0, shuffle_block=2)
    ranks = [TokenShards(str(tmp_path), T, 8 // world, rank=r, world_size=world, seed=3, prefetch=2, shuffle_block=2)
             for r in range(world)]
    for step in range(40):  # past two epochs (113 examples, 8 a batch)
        x, y = one.next_batch()
        for r, loader in enumerate(ranks):
            xr, yr = loader.next_batch()
            assert torch.equal(xr, x[r::world]) and torch.equal(yr, y[r::world]), (step, r)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    for loader in (one, *ranks):
        loader.close()


def test_an_epoch_visits_every_window_of_every_shard_once_block_by_block(tmp_path):
    index = write_corpus(tmp_path, SHARDS)
    loader = TokenShards(str(tmp_path), T, 1, seed=5, prefetch=0, shuffle_block=3)
    order = loader.orders[0]
    seen = [order.example(0, p) for p in range(order.num_examples)]
    assert sorted((s, w) for _, s, w in seen) == [(s, w) for s in range(len(SHARDS))
                                                   for w in range((SHARDS[s] - 1) // T)]
    blocks = [b for b, _, _ in seen]
    assert blocks == sorted(blocks)  # a block is read whole before the next
    for b in set(blocks):  # and holds the examples of its own shards only
        assert {s for bb, s, _ in seen if bb == b} == set(order.blocks(0)[0][b].tolist())
    x, _ = next(iter(TokenShards(str(tmp_path), T, 1, seed=5, prefetch=0, shuffle_block=3)))
    _, s, w = seen[0]
    shard = np.fromfile(tmp_path / order.shards[s].name, dtype="<u2").astype(np.int64)
    assert x[0].tolist() == shard[w * T:w * T + T].tolist()
    assert order.shards[s].name in {sh.name for sh in index.split("train")}


def test_epochs_draw_other_orders_from_the_seed_alone(tmp_path):
    write_corpus(tmp_path, SHARDS)
    a = TokenShards(str(tmp_path), T, 1, seed=5, prefetch=0).orders[0]
    b = TokenShards(str(tmp_path), T, 1, seed=5, prefetch=0).orders[0]
    first = [a.example(0, p) for p in range(a.num_examples)]
    assert first == [b.example(0, p) for p in range(b.num_examples)]
    assert first != [a.example(1, p) for p in range(a.num_examples)]
    loader = TokenShards(str(tmp_path), T, 1, seed=5, prefetch=0)  # and the loader goes on into epoch 1's order
    epochs = [[loader.next_batch()[0] for _ in range(loader.num_examples)] for _ in range(2)]
    assert loader.state_dict()["positions"] == [[2, 0]]
    assert any(not torch.equal(x, y) for x, y in zip(*epochs))
    assert sorted(x.flatten().tolist() for x in epochs[0]) == sorted(x.flatten().tolist() for x in epochs[1])


def test_a_mixture_draws_each_example_by_the_weights_and_keeps_each_corpus_in_its_order(tmp_path):
    write_corpus(tmp_path / "a", [400] * 6, seed=1)
    write_corpus(tmp_path / "b", [400] * 6, seed=2)
    corpora = [str(tmp_path / "a"), str(tmp_path / "b")]
    loader = TokenShards(corpora, T, 16, seed=7, weights=[0.75, 0.25], prefetch=0)
    two = [TokenShards(corpora, T, 8, rank=r, world_size=2, seed=7, weights=[3, 1], prefetch=1) for r in range(2)]
    picks = np.concatenate([loader._corpus_of_slots(b) for b in range(200)])
    assert abs(picks.mean() - 0.25) < 0.02
    for _ in range(30):
        x, _ = loader.next_batch()
        assert all(torch.equal(t.next_batch()[0], x[r::2]) for r, t in enumerate(two))
    for t in (loader, *two):
        t.close()
    with pytest.raises(ValueError, match="one per corpus"):
        TokenShards(corpora, T, 4, weights=[1.0])


@pytest.mark.parametrize("world_after", [1, 4])
def test_a_resumed_loader_continues_mid_epoch_without_replaying_at_any_world_size(tmp_path, world_after):
    write_corpus(tmp_path, SHARDS)
    before = [TokenShards(str(tmp_path), T, 4, rank=r, world_size=2, seed=3) for r in range(2)]
    for _ in range(9):
        for loader in before:
            loader.next_batch()
    state = before[0].state_dict()
    assert state["batch"] == 9 and 0 < state["positions"][0][1] < before[0].num_examples  # mid-epoch
    after = [TokenShards(str(tmp_path), T, 8 // world_after, rank=r, world_size=world_after, seed=3)
             for r in range(world_after)]
    for loader in after:
        loader.load_state_dict(state)
    for _ in range(20):
        want = torch.stack([ld.next_batch()[0] for ld in before], 1).flatten(0, 1)
        got = torch.stack([ld.next_batch()[0] for ld in after], 1).flatten(0, 1)
        assert torch.equal(want, got)
    other = TokenShards(str(tmp_path), T, 4, rank=0, world_size=2, seed=4)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    for loader in (*before, *after, other):
        loader.close()


def test_a_corpus_in_a_store_gives_the_local_batches_through_a_bounded_cache(tmp_path):
    shards = [256] * 40  # 20x the cache below
    write_corpus(tmp_path / "local", shards)
    cache_mb = 2 * 256 * 2 / 2**20  # two shards: blocks of one, the read one and the next
    with s3_server("corpora1") as fs:
        write_corpus("s3://corpora1/c", shards, fs=fs)
        remote = TokenShards("s3://corpora1/c", T, 4, seed=1, cache_dir=tmp_path / "cache", cache_mb=cache_mb,
                             shuffle_block=1)
        local = TokenShards(str(tmp_path / "local"), T, 4, seed=1, shuffle_block=1)
        most = 0
        for _ in range(2 * remote.num_examples // 4):  # two epochs
            assert torch.equal(remote.next_batch()[0], local.next_batch()[0])
            most = max(most, remote.cached_bytes())
        fetched = remote.caches[0].fetched_bytes
        remote.close()
        local.close()
    assert 0 < most <= cache_mb * 2**20
    assert fetched >= 2 * 40 * 512  # each epoch fetched the corpus again: it does not fit the cache


def test_a_cache_too_small_for_the_shards_read_at_once_is_refused(tmp_path):
    with s3_server("corpora2") as fs:
        write_corpus("s3://corpora2/c", [256] * 8, fs=fs)
        with pytest.raises(DataError, match="cannot hold the shards read at once"):
            TokenShards("s3://corpora2/c", T, 4, cache_dir=tmp_path, cache_mb=1000 / 2**20, shuffle_block=4)


def _cache(tmp_path, fs_root, **kw):
    store, index = load_index(fs_root)
    return ShardCache(store, index, tmp_path / "cache", 10**9, **kw), index


def test_a_shard_altered_or_missing_is_named_and_a_truncated_cached_copy_is_fetched_again(tmp_path):
    with s3_server("corpora3") as fs:
        write_corpus("s3://corpora3/c", [300, 300], fs=fs)
        cache, index = _cache(tmp_path, "s3://corpora3/c")
        first, second = index.split("train")
        cache.open(first)
        (tmp_path / "cache" / first.name).write_bytes(b"\0" * 10)  # truncated in the cache
        cache.verified.clear()  # as a new process would find it
        assert len(cache.open(first)) == first.tokens
        fs.pipe_file(f"corpora3/c/{second.name}", b"\1" * (second.tokens * 2))  # same size, other bytes
        with pytest.raises(DataError, match=f"{second.name} does not match index.json"):
            cache.open(second)
        fs.rm_file(f"corpora3/c/{second.name}")
        with pytest.raises(DataError, match=f"{second.name} is missing"):
            cache.open(second)
        assert not any(p.name.startswith(".") for p in (tmp_path / "cache").iterdir())  # no temporary left


def test_a_local_shard_altered_or_truncated_stops_with_its_name(tmp_path):
    index = write_corpus(tmp_path, [300, 300])
    first, second = index.split("train")
    data = bytearray((tmp_path / first.name).read_bytes())
    data[7] ^= 1
    (tmp_path / first.name).write_bytes(bytes(data))
    (tmp_path / second.name).write_bytes(b"\0" * 12)
    store, index = load_index(str(tmp_path))
    cache = ShardCache(store, index, None, 0)
    with pytest.raises(DataError, match=f"{first.name} does not match its sha256"):
        cache.open(first)
    with pytest.raises(DataError, match=f"{second.name} has 12 bytes, the index says 600"):
        cache.open(second)


def test_a_store_down_for_a_while_is_waited_for_and_one_down_too_long_stops_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(store_module, "FIRST_BACKOFF_S", 0.01)
    with s3_server("corpora4") as fs:
        write_corpus("s3://corpora4/c", [300, 300], fs=fs)
        cache, index = _cache(tmp_path, "s3://corpora4/c")
        real, failures = cache.store.fs.get_file, []

        def flaky(*args, **kwargs):
            if len(failures) < 4:
                failures.append(1)
                raise ConnectionError("Could not connect to the endpoint URL")
            return real(*args, **kwargs)

        monkeypatch.setattr(cache.store.fs, "get_file", flaky)
        assert len(cache.open(index.split("train")[0])) == 300
        assert "waiting for s3://corpora4/c/train-00000.bin" in capsys.readouterr().err
        down = CorpusStore("s3://corpora4/c", timeout_s=0.05)
        monkeypatch.setattr(down.fs, "cat_file", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("down")))
        with pytest.raises(DataError, match="no answer for 0 s"):
            down.read("index.json")


def test_a_full_cache_disk_evicts_what_is_not_in_use_then_says_what_to_do(tmp_path, monkeypatch):
    with s3_server("corpora5") as fs:
        write_corpus("s3://corpora5/c", [300, 300, 300], fs=fs)
        cache, index = _cache(tmp_path, "s3://corpora5/c")
        a, b, c = index.split("train")
        cache.open(a)
        cache.open(b)
        cache.keep = {b.name}
        real, calls = cache.store.fetch, []

        def full_once(name, path):
            calls.append(name)
            if len(calls) == 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(name, path)

        monkeypatch.setattr(cache.store, "fetch", full_once)
        cache.open(c)
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [b.name, c.name]  # a evicted, b in use
        monkeypatch.setattr(cache.store, "fetch", lambda name, path: (_ for _ in ()).throw(
            OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(DataError, match="out of disk space.*--data.cache_dir"):
            cache.open(a)


def test_hdfs_is_refused_with_the_reason_where_no_libhdfs_is_present():
    with pytest.raises(DataError, match="HDFS needs pyarrow with libhdfs"):
        CorpusStore("hdfs://namenode:8020/corpus")


def test_a_directory_without_an_index_is_not_read(tmp_path):
    write_corpus(tmp_path, [300, 300])
    (tmp_path / "index.json").unlink()
    with pytest.raises(DataError, match="holds no index.json.*--resume"):
        load_index(str(tmp_path))


def test_a_store_timeout_the_process_group_would_outlast_is_refused_before_the_run(tmp_path):
    from tests.helpers.dist import run_main

    with s3_server("corpora7") as fs:
        write_corpus("s3://corpora7/c", [300, 300], fs=fs)
        proc = run_main("train", "--corpus", "s3://corpora7/c", "--data.store_timeout_s", "300", "--out",
                        str(tmp_path / "r"))
    assert proc.returncode == 2 and "must be less than --dist.timeout_s 300" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_no_credentials_is_an_answer_not_an_outage(monkeypatch):
    monkeypatch.setattr(store_module, "FIRST_BACKOFF_S", 10.0)  # a retry would show as a long wait
    store = CorpusStore("s3://anything/c", timeout_s=60)
    error = type("NoCredentialsError", (Exception,), {})("Unable to locate credentials")
    monkeypatch.setattr(store.fs, "cat_file", lambda *a, **k: (_ for _ in ()).throw(error))
    with pytest.raises(DataError, match="cannot read s3://anything/c/index.json: NoCredentialsError"):
        store.read("index.json")


def test_a_mixture_of_two_tokenizers_is_refused_and_batches_are_contiguous(tmp_path):
    write_corpus(tmp_path / "a", [400] * 2)
    write_corpus(tmp_path / "b", [400] * 2, seed=1)
    x, y = TokenShards([str(tmp_path / "a"), str(tmp_path / "b")], T, 4, weights=[1, 1], prefetch=0).next_batch()
    assert x.is_contiguous() and y.is_contiguous()  # a model's targets.view(-1) works on them
    (tmp_path / "b" / "tokenizer.json").write_text('{"another": "tokenizer"}')  # the same vocabulary size, other ids
    with pytest.raises(DataError, match="prepared with another tokenizer than"):
        TokenShards([str(tmp_path / "a"), str(tmp_path / "b")], T, 4, weights=[1, 1])


def test_train_help_lists_the_data_settings():
    from tests.helpers.dist import run_main

    proc = run_main("train", "--help")
    assert proc.returncode == 0 and "--data.store_timeout_s" in proc.stdout and "--data.weights" in proc.stdout


def test_a_bucket_that_does_not_exist_is_named(tmp_path):
    with s3_server("corpora8") as fs:
        write_corpus("s3://corpora8/c", [300, 300], fs=fs)
        with pytest.raises(DataError, match="the bucket corpora9 does not exist"):
            load_index("s3://corpora9/c")
        with pytest.raises(DataError, match="holds no index.json"):
            load_index("s3://corpora8/elsewhere")
