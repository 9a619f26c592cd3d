"""Shared by every test: one thread in the pytest process, and the `multirank` marker put on each test that starts
ranks, found from the code it runs rather than written by hand (markers: pyproject.toml; docs/testing.md)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch

from minitrain.runtime.launch import launch
from tests.helpers.dist import run_cli, run_cli_and_signal, run_ranks, run_script

# The parent test process stays single-threaded too: ranks it spawns share 2 cores.
torch.set_num_threads(1)

# What starts ranks: the harness (ranks from the launcher's fork server; a user's script on N ranks; the minitrain
# command or torchrun as a subprocess group, whose ranks are processes of their own) and the launcher itself.
# Marked by hand, in its file: a test that starts ranks some other way (torchrun inside a Pod, Slurm, the zygote),
# or through run_main (the command in this process: `train` forks its ranks unless it refuses first, which only
# running it tells). _ranks_only_where_marked keeps those marks true: an unmarked test that reaches the launcher
# fails, naming the marker.
RANK_STARTERS = (run_ranks, run_script, run_cli, run_cli_and_signal, launch)
TESTS = Path(__file__).resolve().parent


def _ours(obj) -> bool:
    """Defined in this test tree (a test module, a helper): worth reading for what it calls."""
    if isinstance(obj, types.FunctionType):
        where = obj.__code__.co_filename
    else:
        module = obj if isinstance(obj, types.ModuleType) else sys.modules.get(getattr(obj, "__module__", None) or "")
        where = getattr(module, "__file__", None) or ""
    return Path(where).resolve().is_relative_to(TESTS)


def _modules(names: set[str]) -> list[types.ModuleType]:
    """The modules a function imports inside itself (`from tests.helpers.dist import run_cli` in its body)."""
    for name in names:
        if name.startswith("tests.") and name not in sys.modules:
            importlib.import_module(name)
    return [sys.modules[n] for n in names if "." in n and n in sys.modules]


def _read(fn: types.FunctionType) -> set[str]:
    """The global and attribute names `fn`'s code reads, nested functions and lambdas included."""
    names, codes = set(), [fn.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def _starts_ranks(obj, seen: set[int]) -> bool:
    """Whether calling `obj` can reach one of RANK_STARTERS through code of this test tree."""
    obj = inspect.unwrap(obj.func if isinstance(obj, functools.partial) else obj)
    obj = getattr(getattr(obj, "hypothesis", None), "inner_test", obj)  # a @given test: the function it wraps
    if any(obj is starter for starter in RANK_STARTERS):
        return True
    if id(obj) in seen or not _ours(obj):
        return False
    seen.add(id(obj))
    if isinstance(obj, type):  # a helper class: its methods
        return any(_starts_ranks(v, seen) for v in vars(obj).values() if inspect.isfunction(v))
    if not inspect.isfunction(obj):
        return False
    names = _read(obj)
    modules = [obj.__globals__[n] for n in names & obj.__globals__.keys()
               if isinstance(obj.__globals__[n], types.ModuleType)] + _modules(names)
    values = [obj.__globals__[n] for n in names & obj.__globals__.keys()]
    values += [getattr(m, n) for m in modules if _ours(m) or m.__name__ == launch.__module__
               for n in names if hasattr(m, n)]  # `multinode.train_each`
    return any(_starts_ranks(v, seen) for v in values if not isinstance(v, types.ModuleType))


def _fixture_functions(item: pytest.Item):
    """The functions of the fixtures `item` uses, but this file's own (the guard below reads `launch`)."""
    for defs in getattr(item, "_fixtureinfo").name2fixturedefs.values():
        func = inspect.unwrap(defs[-1].func)
        if getattr(func, "__code__", None) is None or func.__code__.co_filename != __file__:
            yield func


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not isinstance(item, pytest.Function) or item.get_closest_marker("multirank"):
            continue
        seen: set[int] = set()
        if _starts_ranks(item.function, seen) or any(_starts_ranks(f, seen) for f in _fixture_functions(item)):
            item.add_marker(pytest.mark.multirank)


@pytest.fixture(autouse=True)
def _ranks_only_where_marked(request, monkeypatch):
    """A test not marked multirank that reaches the launcher in this process fails at once, saying so. Every module
    that imported `launch` gets a stand-in for the test; the launcher's own module keeps it, so a module first
    imported during a test takes the real one (and is watched from the next test on)."""
    if request.node.get_closest_marker("multirank"):
        return
    with contextlib.suppress(ImportError):  # the commands' modules import `launch`: watched from the first test on
        importlib.import_module("minitrain.apps.cli")

    def unmarked(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts ranks but is not marked multirank: add "
                    "@pytest.mark.multirank (tests/conftest.py marks only what calls the harness's rank starters)",
                    pytrace=False)

    for name, module in list(sys.modules.items()):
        if (name.split(".")[0] in ("minitrain", "tests") and name not in (launch.__module__, __name__)
                and getattr(module, "launch", None) is launch):
            monkeypatch.setattr(module, "launch", unmarked)
