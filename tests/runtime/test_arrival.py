"""Calls every rank must make together (runtime/arrival.py): a rank alone in one is found and named with its line,
and only a rank that can never come stops the others; one that is slow, or whose collective the others have
already issued, is waited for."""
from __future__ import annotations

import sys
import time

import pytest
import torch

import minitrain
from minitrain.runtime.arrival import Arrival, _cannot_come, _odd_ones, _positions
from minitrain.runtime.comm import CollectiveError
from minitrain.runtime.diagnosis import user_call

from tests.helpers.dist import run_ranks

HERE = Arrival("world@0", 3, [0, 1])


def _at(group: str, number: int | None, op: str = "all_reduce", members=(0, 1)) -> dict:
    """A rank waiting in a collective, the `number`th symmetric one of its group (None: point to point)."""
    return {"rank": 1, "at": [group, 40, op, [[4]], "float64", "buckets.py:100"], "symmetric": number,
            "members": list(members), "user": ["backward", "train.py:305"]}


def _posted(issued: int) -> dict[int, dict]:
    return {0: {"what": "optimizer.state_dict()", "site": "train.py:283", "issued": {"world": issued}}}


def test_a_rank_waiting_in_a_collective_the_others_have_not_issued_can_never_come():
    assert _cannot_come(_at("world", 13), HERE, _posted(12))  # rank 0 issued 12: #13 needs it, and it waits here


def test_a_rank_waiting_in_a_collective_the_others_have_issued_is_waited_for():
    """Rank 0 launched its reduction #13 before it came here (in flight, as ZeRO-2's are): rank 1's #13 finishes."""
    assert not _cannot_come(_at("world", 13), HERE, _posted(13))
    assert not _cannot_come(_at("world", 13, members=(1, 2)), HERE, _posted(12))  # a group without a rank here
    assert not _cannot_come(_at("pp", None, op="send"), HERE, _posted(0))  # point to point: one-sided, undecided


def test_where_a_rank_is_decides_whether_it_can_come():
    assert not _cannot_come(None, HERE, _posted(0))  # silent: the timeout tells
    assert not _cannot_come({"rank": 1, "where": "train.py:90", "user": [None, "train.py:90"]}, HERE, _posted(0))
    assert _cannot_come({"rank": 1, "closed": True, "last": None}, HERE, _posted(0))
    previous = Arrival("world@0", 2, [0, 1]).as_json()  # still finishing the arrival before: it comes next
    assert not _cannot_come({"rank": 1, "where": "arrival.py:1", "arriving": previous}, HERE, _posted(0))
    elsewhere = Arrival("dp@0", 7, [0, 1]).as_json()  # at another group's, which waits for rank 0 (here)
    assert _cannot_come({"rank": 1, "where": "arrival.py:1", "arriving": elsewhere}, HERE, _posted(0))
    apart = Arrival("dp@2", 7, [1, 3]).as_json()  # at the arrival of a group without a rank that waits here
    assert not _cannot_come({"rank": 1, "where": "arrival.py:1", "arriving": apart}, HERE, _posted(0))
    assert _cannot_come({"rank": 1, "where": "c10d.py:9", "user": ["torch.distributed.barrier()", "train.py:7"]},
                        HERE, _posted(0))


def test_the_message_names_each_ranks_call_and_line_and_the_odd_one_out():
    states = {1: _at("world", 13)}
    assert _positions(_posted(12), states) == ("rank 0 is in optimizer.state_dict() at train.py:283; "
                                               "rank 1 is in backward at train.py:305")
    assert _odd_ones(_posted(12), states) == [0]  # a tie: the rank that came alone
    three = {**_posted(12), 2: {"what": "optimizer.state_dict()", "site": "train.py:283", "issued": {}}}
    assert _odd_ones(three, states) == [1]
    assert _positions(three, states).startswith("ranks 0, 2 are in optimizer.state_dict() at train.py:283; rank 1")


def test_the_users_line_is_the_one_that_called_into_torch_or_minitrain():
    """From inside a model's forward (a module called by a module), the line that called the model."""
    seen = []

    class Inner(torch.nn.Module):
        def forward(self, x):
            seen.append(user_call(sys._getframe()))
            return x

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x)

    Outer()(torch.ones(1)); line = sys._getframe().f_lineno  # noqa: E702 - the line the model is called from
    assert seen == [("the model's forward", f"test_arrival.py:{line}")]
    assert user_call(sys._getframe()) == (None, f"test_arrival.py:{sys._getframe().f_lineno}")  # in Python


# --- on two ranks ------------------------------------------------------------------------------------------------
def _two_calls(topo):
    minitrain.init_distributed(topology=topo, timeout_s=60)
    model = torch.nn.Linear(4, 4).double()
    model, optimizer = minitrain.prepare(model, torch.optim.AdamW(model.parameters()), zero=1)
    start = time.monotonic()
    try:
        if topo.rank == 0:
            minitrain.full_state_dict(model)  # site: rank 0
        else:
            optimizer.state_dict()  # site: rank 1
    except CollectiveError as e:
        return str(e), time.monotonic() - start
    return "went on", 0.0


def _finished_early(topo):
    minitrain.init_distributed(topology=topo, timeout_s=60)
    model = torch.nn.Linear(4, 4).double()
    model, optimizer = minitrain.prepare(model, torch.optim.AdamW(model.parameters()), zero=1)
    if topo.rank == 1:
        return "finished"  # its process group closes: it will never come
    start = time.monotonic()
    with pytest.raises(CollectiveError) as raised:
        optimizer.state_dict()
    return str(raised.value), time.monotonic() - start


def _site(marker: str) -> str:
    [line] = [i + 1 for i, text in enumerate(open(__file__).read().splitlines()) if text.endswith(f"# site: {marker}")]
    return f"test_arrival.py:{line}"


def test_two_ranks_at_different_calls_both_stop_naming_both():
    for message, took in run_ranks(_two_calls, 2):
        assert (f"rank 0 is in minitrain.full_state_dict() at {_site('rank 0')}; "
                f"rank 1 is in optimizer.state_dict() at {_site('rank 1')}") in message, message
        assert took < 10, took


def test_a_rank_that_finished_stops_the_one_waiting_for_it_within_seconds():
    message, took = run_ranks(_finished_early, 2)[0]
    assert "rank 1 is finished (it has closed the process group)" in message, message
    assert took < 30, took  # the session's timeout is 60 s: it was not waited for


def test_under_the_users_own_process_group_a_rank_is_waited_for_as_long_as_its_collectives_would_wait(tmp_path):
    """A script's own init_process_group(timeout=...) sets how long minitrain's calls wait for a slow rank (less the
    margin its watch keeps to speak first), as that group's collectives would, where 300 s applied before."""
    from tests.helpers.dist import run_script

    script = tmp_path / "own_group.py"
    script.write_text("import datetime\nimport torch.distributed as dist\nimport minitrain\n"
                      "from minitrain.api.session import current\n"
                      "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=77))\n"
                      "minitrain.init_distributed()\nprint('waits', current().timeout_s)\n")
    for code, output in run_script(script, 2, logs=tmp_path):
        assert code == 0 and "waits 67.0" in output, output
