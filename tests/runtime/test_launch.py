import os
import time

import pytest
import torch

from minitrain.runtime.launch import LaunchTimeoutError, RankFailedError, launch

from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.slow


def _identity(topo):
    return (topo.rank, topo.world_size, torch.get_num_threads(), os.environ["OMP_NUM_THREADS"], os.getpid())


def _raise_on_rank_2(topo):
    if topo.rank == 2:
        raise ValueError("deliberate failure on rank 2")
    t = torch.zeros(1)
    topo.dp.all_reduce_sum(t)  # the others block here until rank 2's death breaks the collective


def _killed_on_rank_1(topo):
    if topo.rank == 1:
        os._exit(7)
    topo.dp.barrier()


def _hang_on_rank_1(topo):
    if topo.rank == 1:
        time.sleep(600)
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_get_identity_and_one_thread():
    results = run_ranks(_identity, 4)
    assert [r[:4] for r in results] == [(r, 4, 1, "1") for r in range(4)]
    time.sleep(0.2)
    assert not any(_alive(r[4]) for r in results)


def _variable(_topo, name: str):
    return os.environ.get(name)


def test_a_variable_set_after_the_fork_server_started_reaches_the_ranks(monkeypatch):
    # Ranks fork from a server started by the first launch: they got its environment, so credentials a test (or a
    # program) set later never reached them.
    run_ranks(_variable, 1, "MINITRAIN_SET_LATE")  # the server is up
    monkeypatch.setenv("MINITRAIN_SET_LATE", "seen")
    assert run_ranks(_variable, 2, "MINITRAIN_SET_LATE") == ["seen", "seen"]
    monkeypatch.delenv("MINITRAIN_SET_LATE")
    assert run_ranks(_variable, 1, "MINITRAIN_SET_LATE") == [None]


def test_failure_on_one_rank_ends_all_and_names_it():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(_raise_on_rank_2, 4, backend="gloo", pg_timeout_s=60, timeout_s=60)
    assert time.monotonic() - start < 30  # noticed at once, not at the 60 s timeout
    err = info.value
    assert err.rank == 2 and "deliberate failure on rank 2" in err.detail and "Traceback" in err.detail
    assert str(err).count("ValueError: deliberate failure") == 1  # the traceback is shown once


def test_rank_killed_without_traceback_is_reported():
    with pytest.raises(RankFailedError) as info:
        launch(_killed_on_rank_1, 3, backend="gloo", pg_timeout_s=60, timeout_s=60)
    assert info.value.rank == 1 and "exited with code 7" in info.value.detail


def _rank_1_leaves(topo):
    """Rank 1 dies; rank 0 reads how from the run's store, where the launcher posts it."""
    import torch.distributed as dist

    from minitrain.runtime.launch import left_key

    if topo.rank == 1:
        os._exit(7)
    if topo.rank == 0:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        store.wait([left_key(1)])
        return store.get(left_key(1)).decode()
    return "still here"


def test_a_rank_that_may_leave_is_posted_as_left_and_the_others_go_on(capfd):
    results = launch(_rank_1_leaves, 3, backend="gloo", pg_timeout_s=60, timeout_s=60, may_leave=[1])
    assert results == ["process exited with code 7 before reporting a result", None, "still here"]
    assert "rank 1 left the run (process exited with code 7" in capfd.readouterr().err
    # Any other rank's failure is still the run's: here rank 1 is not allowed to leave.
    with pytest.raises(RankFailedError):
        launch(_rank_1_leaves, 3, backend="gloo", pg_timeout_s=60, timeout_s=60, may_leave=[2])


def test_hang_hits_the_hard_timeout_and_kills_the_group():
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match=r"\[1\] still running"):
        launch(_hang_on_rank_1, 2, backend="gloo", pg_timeout_s=60, timeout_s=5)
    assert time.monotonic() - start < 15


def _hang_rank_one_at_step_three(topo, stamp):
    import time as _time


    from minitrain.train.run_config import run_config
    from minitrain.train.trainer import Trainer

    cfg = run_config(cli_values={"train.zero": 3, "dist.nproc": topo.world_size, "train.log_every": 0})
    trainer = Trainer(cfg, topo)
    for _ in range(2):
        trainer.train_step()
    if topo.rank == 1:
        with open(stamp, "w") as f:
            f.write(repr(_time.time()))
        _time.sleep(120)  # hung: never reaches step 3's collectives
    trainer.train_step()


def test_a_hung_rank_ends_every_rank_within_the_timeout_naming_step_and_op(tmp_path):
    stamp = tmp_path / "hung-at"
    with pytest.raises(RankFailedError) as failed:
        launch(_hang_rank_one_at_step_three, 3, str(stamp), backend="gloo", pg_timeout_s=5, timeout_s=60)
    since_hang = time.time() - float(stamp.read_text())
    message = str(failed.value)
    assert since_hang < 15, since_hang  # 5 s collective timeout; every rank gone (launch returned)
    assert "step 3:" in message and "all_gather" in message, message


def test_no_rank_outlives_a_killed_launcher(tmp_path):
    import signal

    from tests.helpers.dist import run_cli_and_signal

    # SIGKILL: the launcher gets no chance to clean up. The harness waits until the output pipe,
    # which every rank inherited, closes: that is, until every rank has gone too.
    proc = run_cli_and_signal("train", "--nproc", "2", "--steps", "100000", "--out", str(tmp_path),
                              signum=signal.SIGKILL, after_line="step ", timeout_s=30)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10  # ...and the process table agrees, once they are reaped
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail("ranks (or the fork server) still running 10 s after the launcher was killed")


def _threads_after_training_and_close(topo, out):
    from pathlib import Path

    from minitrain.apps.cli import build_parser, resolve_config
    from minitrain.train.loop import train_worker

    cfg = resolve_config(build_parser().parse_args(["train", "--tp", "2", "--zero", "3", "--steps", "2", "--out", out,
                                                    "--train.log_every", "0"]))
    train_worker(topo, cfg)  # leaves its strategy reachable from autograd hooks, as any finished run does
    topo.close()
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_closing_the_topology_ends_every_backend_thread(tmp_path):
    # A process group's threads live as long as a reference to it does. Left to the interpreter's exit, one
    # still running made about 1 in 40 finished torchrun ranks abort ("terminate called without an active
    # exception"); so close() ends them all, subgroups included, before the process exits.
    for names in run_ranks(_threads_after_training_and_close, 2, str(tmp_path)):
        assert not [n for n in names if "gloo" in n], names


def _collective_after_close(topo):
    topo.close()
    try:
        topo.dp.all_reduce_sum(torch.zeros(1))
    except Exception as e:  # noqa: BLE001 - the test wants to see which error it is
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_comm_refuses_collectives_after_its_topology_closed():
    # After close, a Comm no longer holds its group: a call must fail, not land on another default group.
    for said in run_ranks(_collective_after_close, 2):
        assert said == "CollectiveError: all_reduce on world after its topology was closed (Topology.close)"


@pytest.mark.parametrize("agent_store", [False, True])
def test_ranks_whose_agents_count_restarts_differently_meet_where_rank_0_serves_a_new_store(agent_store):
    """A node lost and back under torchrun's c10d rendezvous (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): its new agent
    counts restarts from 0 while the others count on, so the restart count cannot name the attempt. Rank 0 serves a
    new store every attempt there, so no name is needed: ranks 0 and 1, told restart counts 2 and 0, meet. Where the
    agent's store outlives attempts, the count still keeps attempts apart (their keys do not meet)."""
    import threading
    from datetime import timedelta

    from minitrain.runtime.launch import free_port
    from minitrain.runtime.topology import _rendezvous_store

    port = free_port()
    server = None
    if agent_store:  # the agent's store, which the ranks join as clients
        import torch.distributed as dist

        server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    stores = {}

    def join(rank, restarts):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(restarts),
               "TORCHELASTIC_USE_AGENT_STORE": str(agent_store)}
        stores[rank] = _rendezvous_store(rank, 2, timedelta(seconds=30), env)

    threads = [threading.Thread(target=join, args=(rank, restarts)) for rank, restarts in ((0, 2), (1, 0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stores[0].set("address-of-0", "here")
    assert stores[1].check(["address-of-0"]) is not agent_store
    del server
