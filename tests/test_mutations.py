"""The mutation list (tools/mutations.toml, `make mutate`) still applies to the source as it is: each mutant's
`find` text occurs once in its file, the mutated file compiles, its tests exist. A change that moves the text a
mutant names would otherwise go unnoticed until the next `make mutate`, which stops on stale entries."""
from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "mutate.py"


def test_every_mutant_still_applies_to_the_source():
    spec = importlib.util.spec_from_file_location("mutate_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    stale = {m["id"]: reason for m in tool.load() if (reason := tool.stale_reason(m))}
    assert not stale, f"update these entries of tools/mutations.toml to the current source: {stale}"
