import torch

from minitrain.runtime.comm import Comm

from tests.helpers.dist import run_ranks


def _collectives(topo):
    comm, r, n = topo.dp, topo.rank, topo.world_size
    t = torch.full((4,), float(r + 1), dtype=torch.float64)
    comm.all_reduce_sum(t)
    assert torch.all(t == n * (n + 1) / 2)
    b = torch.full((3,), float(r))
    comm.broadcast(b, src=n - 1)
    assert torch.all(b == n - 1)
    full = torch.arange(2 * n, dtype=torch.float32) * (r + 1)
    shard = torch.empty(2)
    comm.reduce_scatter_sum(shard, full)
    assert torch.equal(shard, torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) * (n * (n + 1) / 2))
    gathered = torch.empty(2 * n)
    comm.all_gather(gathered, shard)
    assert torch.equal(gathered, torch.arange(2 * n, dtype=torch.float32) * (n * (n + 1) / 2))
    # Above 1 MiB gloo's gather runs as one broadcast per rank: the same result, booked as one all_gather.
    big = torch.full((n, 300_000), -1.0)
    comm.all_gather(big.view(-1), torch.full((300_000,), float(r)))
    pending = comm.all_gather_async(gathered := torch.empty(n * 300_000), torch.arange(300_000.0) + r)
    pending.wait()
    assert torch.equal(big, torch.arange(n, dtype=torch.float32)[:, None].expand(n, 300_000))
    assert torch.equal(gathered.view(n, -1), torch.arange(300_000.0) + torch.arange(n, dtype=torch.float32)[:, None])
    rows = comm.gather_rows(torch.tensor([r, 10 * r], dtype=torch.int64))
    assert rows.tolist() == [[i, 10 * i] for i in range(n)]
    if r == 0 and n > 1:
        comm.send(torch.tensor([42.0]), dst=1)
    elif r == 1:
        got = torch.zeros(1)
        comm.recv(got, src=0)
        assert got.item() == 42.0
    comm.barrier()
    return {op: (s.calls, s.bytes) for op, s in comm.stats.items()}


def test_collectives_compute_and_count():
    stats = run_ranks(_collectives, 3)
    s0 = stats[0]
    assert s0["all_reduce"] == (1, 32)
    assert s0["broadcast"] == (1, 12)
    assert s0["reduce_scatter"] == (1, 24)  # the full input
    # full outputs: 6 floats, twice 3 x 300,000 floats, then 3 ranks x 2 int64
    assert s0["all_gather"] == (4, 24 + 2 * 3 * 300_000 * 4 + 48)
    assert s0["send"] == (1, 4) and stats[1]["recv"] == (1, 4) and "send" not in stats[2]
    assert s0["barrier"] == (1, 0)


def test_world_of_one_is_identity_and_moves_nothing():
    comm = Comm()
    t = torch.arange(4.0)
    comm.all_reduce_sum(t)
    out = torch.empty(4)
    comm.reduce_scatter_sum(out, t)
    comm.all_gather(out, t)
    assert torch.equal(out, torch.arange(4.0)) and comm.gather_rows(t).shape == (1, 4)
    assert comm.totals().calls == 0 and comm.totals().bytes == 0


def _issued_alone(topo):
    # A one-rank world whose Comm hands every collective to gloo: the same results, each one counted and timed;
    # and a ZeRO-3 step through it equals the step whose collectives were skipped.
    from minitrain.train.run_config import run_config
    from minitrain.train.trainer import Trainer

    alone = topo.issuing_alone()
    stats = _collectives(alone)
    values = {"train.zero": 3, "train.log_every": 0, "train.dtype": "float64"}
    skipped, issued = Trainer(run_config(cli_values=values), topo), Trainer(run_config(cli_values=values), alone)
    records = [(skipped.train_step(), issued.train_step()) for _ in range(2)]
    same = torch.equal(skipped.strategy.full_params(), issued.strategy.full_params())
    return stats, same, [(a.comm_calls, b.comm_calls, b.comm_time_s) for a, b in records]


def test_a_world_of_one_can_issue_its_collectives_to_the_backend():
    [(stats, same, calls)] = run_ranks(_issued_alone, 1)
    assert stats["all_reduce"] == (1, 32) and stats["reduce_scatter"] == (1, 8) and stats["barrier"] == (1, 0)
    assert same
    assert all(skipped == 0 and issued > 0 and seconds > 0 for skipped, issued, seconds in calls), calls
