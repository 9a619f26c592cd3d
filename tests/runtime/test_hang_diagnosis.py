"""Hangs that name the culprit, and the periodic fingerprint check (collective_watch.py), through the launcher.

Four gloo ranks with a 3 s collective timeout: the watch must end every rank soon after it with one diagnosis
that names the rank that is elsewhere and both call sites (the lines marked `# site:` below)."""
import re
import time
from pathlib import Path

import pytest
import torch

from minitrain.runtime.launch import RankFailedError, launch

from tests.helpers.dist import run_ranks

TIMEOUT_S = 3.0
# After the timeout: a poll of the watch (0.5 s), the other ranks' polls and answers, the launcher's grace (0.5 s)
# and its reaping; generous, for a machine busy with other tests.
SLACK_S = 6.0
SOURCE = Path(__file__).read_text().splitlines()


def _site(marker: str) -> str:
    """'test_hang_diagnosis.py:N' of the line marked `# site: marker`."""
    lines = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# site: {marker}")]
    assert len(lines) == 1, marker
    return f"test_hang_diagnosis.py:{lines[0]}"


def _stamp(topo, path: str) -> None:
    """Rank 0 notes when the hang begins (after start-up, which the bound below leaves out)."""
    if topo.rank == 0:
        Path(path).write_text(repr(time.time()))


def _skips_an_all_reduce(topo, stamp):
    t = torch.ones(4)
    topo.dp.all_reduce_sum(t)
    _stamp(topo, stamp)
    if topo.rank != 3:
        topo.dp.all_reduce_sum(t)  # site: the all_reduce rank 3 skips
    topo.dp.all_gather(torch.empty(16), t)  # site: all_gather


def _calls_another_op(topo, stamp):
    t = torch.ones(4)
    topo.dp.all_reduce_sum(t)
    _stamp(topo, stamp)
    if topo.rank == 1:
        topo.dp.broadcast(t, src=0)  # site: rank 1's broadcast
    else:
        topo.dp.all_reduce_sum(t)  # site: the others' all_reduce


def _stuck_in_python(topo, stamp):
    t = torch.ones(4)
    topo.dp.all_reduce_sum(t)  # site: the last all_reduce rank 2 finishes
    _stamp(topo, stamp)
    if topo.rank == 2:
        time.sleep(120)  # site: rank 2 asleep
    topo.dp.all_reduce_sum(t)  # site: the all_reduce the others wait in


def _hang(fn, tmp_path) -> tuple[RankFailedError, float]:
    """Run fn on 4 ranks; the launcher's error, and the seconds from the hang's start to the last rank's end."""
    stamp = tmp_path / "hang-started"
    with pytest.raises(RankFailedError) as failed:
        launch(fn, 4, str(stamp), backend="gloo", pg_timeout_s=TIMEOUT_S, timeout_s=60)
    return failed.value, time.time() - float(stamp.read_text())


def test_a_rank_that_skipped_an_all_reduce_is_named_at_its_all_gather(tmp_path):
    error, took = _hang(_skips_an_all_reduce, tmp_path)
    message = str(error)
    assert error.rank == 3, message  # the culprit's report is the one shown
    assert (f"rank 3 is at all_gather #2 on world ({_site('all_gather')}) while ranks 0-2 wait in "
            f"all_reduce #2 on world ({_site('the all_reduce rank 3 skips')})") in message, message
    assert message.count("collective hang") == 1, message  # one diagnosis, shown once
    assert took < TIMEOUT_S + SLACK_S, took


def test_a_rank_that_calls_another_op_is_named(tmp_path):
    error, took = _hang(_calls_another_op, tmp_path)
    message = str(error)
    broadcast, all_reduce = _site("rank 1's broadcast"), _site("the others' all_reduce")
    assert error.rank == 1, message
    assert (f"rank 1 is at broadcast #2 on world ({broadcast}) while ranks 0, 2, 3 wait in all_reduce #2 on world "
            f"({all_reduce})") in message, message
    assert took < TIMEOUT_S + SLACK_S, took


def test_a_rank_stuck_in_python_is_named_where_it_is(tmp_path):
    error, took = _hang(_stuck_in_python, tmp_path)
    message = str(error)
    assert error.rank == 2, message
    assert (f"rank 2 is not in a collective: in Python at {_site('rank 2 asleep')}, last finished all_reduce #1 "
            f"on world ({_site('the last all_reduce rank 2 finishes')}) while ranks 0, 1, 3 wait in all_reduce #2 "
            f"on world ({_site('the all_reduce the others wait in')})") in message, message
    assert re.search(r"rank 2's main thread at that moment:\n.*time\.sleep\(120\)", message, re.DOTALL), message
    assert took < TIMEOUT_S + SLACK_S, took  # the sleeping rank too: launch returned


def _two_call_sites(topo):
    t = torch.ones(4)
    topo.dp.all_reduce_sum(t)
    if topo.rank == 1:  # the same op and shape, from another line: nothing hangs, but the ranks have diverged
        topo.dp.all_reduce_sum(t)  # site: rank 1's all_reduce
    else:
        topo.dp.all_reduce_sum(t)  # site: the others' same all_reduce
    topo.dp.all_reduce_sum(t)
    topo.watch.at_step(2, 1)  # as the trainer does when step 2 starts, with --dist.fingerprint_every 1


def test_the_periodic_check_names_a_rank_that_called_from_another_line():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as failed:
        launch(_two_call_sites, 4, backend="gloo", pg_timeout_s=TIMEOUT_S, timeout_s=60)
    message = str(failed.value)
    assert failed.value.rank == 1, message
    assert ("fingerprint check after step 1: in group world (ranks 0-3), rank 1 issued other collectives than "
            "ranks 0, 2, 3") in message, message
    others, ones = _site("the others' same all_reduce"), _site("rank 1's all_reduce")
    assert (f"ranks 0, 2, 3 at all_reduce #2 on world of 4 float32 ({others}), rank 1 at all_reduce #2 on world of 4 "
            f"float32 ({ones})") in message, message
    assert time.monotonic() - start < 30  # no timeout involved: start-up and the check


def _train_with_checks(topo):
    from minitrain.train.run_config import run_config
    from minitrain.train.trainer import Trainer

    cfg = run_config(cli_values={"dist.nproc": topo.world_size, "train.zero": 3, "train.log_every": 0,
                                   "dist.fingerprint_every": 1})
    trainer = Trainer(cfg, topo)
    for _ in range(3):
        trainer.train_step()  # steps 2 and 3 start with a check
    return {key: track.checked for key, track in topo.watch._tracks.items()}, topo.watch._previous_check


def test_a_real_training_step_passes_the_check_every_step():
    (counts, last_check), (other_counts, _) = run_ranks(_train_with_checks, 2)
    assert counts == other_counts and counts["world@0"] > 0, (counts, other_counts)
    assert last_check.endswith("check/2/0"), last_check  # the trainer's hook ran two checks
