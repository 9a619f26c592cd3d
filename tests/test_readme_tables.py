"""The README's benchmark tables are what benchmarks/results/*.json give (benchmarks/tables.py), never typed by hand."""
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import each other as top-level modules
import tables

# What the renderers read from each kind of result file. Timed benchmarks also record their steps and repeats.
TIMED = {"steps", "repeats", "format", "results"}
KEYS = {"prepare_vs_peers": TIMED | {"world", "warmup"}, "zero_stages": TIMED | {"model", "warmup"},
        "ddp_modes": TIMED, "activation_checkpointing": TIMED | {"model", "warmup"},
        "tensor_parallel": TIMED | {"tp", "minitrain_over_dtensor"},
        "pipeline": TIMED | {"pp", "microbatches", "minitrain_over_torch"},
        "comm": {"world_size", "backend", "ops"}, "precision_memory": {"world_size", "preset", "results"},
        "torchrun_restarts": {"label", "minitrain_src", "trials", "results"},
        "throughput": {"device", "format", "results"}, "before_after": {"before", "repeats", "format", "results"}}
MACHINE = {"platform", "cpus", "torch", "python"}


def test_readme_tables_equal_what_the_result_files_give():
    assert tables.stale(tables.README.read_text()) == []


def test_a_figure_edited_by_hand_is_caught():
    text = tables.README.read_text()
    block = tables.render("zero_stages")
    step_ms = block.splitlines()[2].split("|")[3]  # the first row's step time, e.g. " 661 "
    edited = text.replace(block, block.replace(f"|{step_ms}|", f"| {int(step_ms) + 1} |", 1))
    assert edited != text
    message = "README.md: table zero_stages differs from benchmarks/results/zero_stages.json; run python benchmarks/tables.py"
    assert tables.stale(edited) == [message]
    assert tables.generate(edited) == text


def test_every_result_file_belongs_to_a_table_and_has_its_keys():
    kinds = {}
    for name, (pattern, _) in tables.TABLES.items():
        kinds.update({path: name for path in tables.RESULTS.glob(pattern)})
    paths = sorted(tables.RESULTS.glob("*.json"))
    assert paths and set(paths) == set(kinds), "a result file no table reads"
    for path in paths:
        doc = json.loads(path.read_text())
        missing = KEYS[kinds[path]] - doc.keys()
        assert not missing, f"{path.name} lacks {sorted(missing)}"
        # Older files recorded neither; a file that records one records both.
        assert ("command" in doc) == ("machine" in doc), path.name
        if "machine" in doc:
            assert doc["command"].startswith("python benchmarks/"), path.name
            assert MACHINE <= doc["machine"].keys(), path.name


def test_the_source_line_never_invents_a_machine():
    old = {"path": "benchmarks/results/x.json"}
    new = {"path": "benchmarks/results/y.json", "command": "python benchmarks/y.py --steps 2",
           "machine": {"platform": "Linux", "processor": "Some CPU", "cpus": 2, "torch": "2.5", "python": "3.11.7"}}
    assert tables.source_line([old]) == "Source: `benchmarks/results/x.json` (command and machine not recorded)."
    assert tables.source_line([new, old]) == (
        "Source: `benchmarks/results/y.json` from `python benchmarks/y.py --steps 2` on Linux, Some CPU, 2 CPUs, "
        "torch 2.5, Python 3.11.7; `benchmarks/results/x.json` (command and machine not recorded).")
