"""The benchmark tables of README.md and docs/*.md are what benchmarks/results/*.json give
(benchmarks/tables.py), never typed by hand."""
import json
import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import each other as top-level modules
import tables

# What the renderers read from each kind of result file. Timed benchmarks also record their steps and repeats.
TIMED = {"steps", "repeats", "format", "results"}
KEYS = {"prepare_vs_peers": TIMED | {"world", "warmup"}, "prepare_vs_peers_w4": TIMED | {"world", "warmup"},
        "zero_stages": TIMED | {"model", "warmup"},
        "zero_stages_gpt2": TIMED | {"model", "warmup"},
        "ddp_modes": TIMED, "activation_checkpointing": TIMED | {"model", "warmup"},
        "offload": TIMED | {"warmup", "batch"},
        "experts": TIMED | {"warmup", "batch", "experts", "top_k"},
        "param_server": {"results", "steps", "slow_s", "repeats", "workers", "model", "val_batches"},
        "data_prefetch": {"results", "steps", "repeats", "depth", "trainer", "user_model", "user_batch"},
        "prepare_throughput": {"results", "repeats", "format", "text_mib", "documents", "tokens", "vocab_size",
                               "batch_docs"},
        "shard_loader": TIMED | {"shards", "loader_corpus_bytes", "loader_cache_bytes", "step_shard_bytes", "seq_len",
                                 "batch_per_rank", "ranks"},
        "moe_balance": {"model", "steps", "seeds", "per_seed", "results"},
        "context_parallel_memory": {"preset", "precision", "memory"},
        "pipeline_schedules": {"preset", "layers", "virtual_stages", "batch", "microbatches", "steps", "warmup",
                               "repeats", "results"},
        "context_parallel_time": {"time_seq", "steps", "warmup", "repeats", "timing"},
        "tensor_parallel": TIMED | {"tp", "minitrain_over_dtensor"},
        "tensor_parallel_llama": TIMED | {"tp", "minitrain_over_dtensor", "model"},
        "pipeline": TIMED | {"pp", "microbatches", "minitrain_over_torch"},
        "pipeline_interleaved": TIMED | {"pp", "microbatches", "virtual_stages", "minitrain_over_torch"},
        "comm": {"world_size", "backend", "ops"}, "precision_memory": {"world_size", "preset", "results"},
        "torchrun_restarts": {"label", "minitrain_src", "trials", "results"},
        "throughput": {"device", "format", "results"}, "throughput_alternating": {"device", "format", "results"},
        "throughput_alternating_gpu": {"device", "format", "results"},
        "step_costs": {"device", "format", "preset", "params", "steps", "warmup", "ms"},
        "before_after": {"before", "repeats", "format", "results"},
        "multinode": {"repeats", "elastic_trials", "rdzv_conf", "exactness", "elastic"},
        "chaos_campaigns": {"seed", "nodes", "steps", "faults", "survived", "launches", "recomputed_steps", "seconds",
                            "checkpoints_written", "checkpoint_bytes_written", "passed", "failures"},
        "chaos_faults": {"seed", "faults"},
        "throughput_gpu": {"device", "format", "results"}, "gpu_throughput_before": {"device", "format", "results"}, "gpu_before_after": {"device", "nccl", "memory", "timings"},
        "offload_gpu": {"device", "timings", "preset", "precision", "batch"},
        "gpu_memory": {"device", "memory"}, "gpu_timings": {"device", "nccl", "timings"},
        "gpu_against_plain": {"device", "against_plain", "peak"},
        "object_store": {"preset", "bytes", "repeats", "format", "results"},
        "zero3_read_guard": {"steps", "repeats", "rows"}, "host_adam_vs_deepspeed": {"steps", "repeats", "rows"},
        "nanogpt_port": {"nanogpt", "port", "runs"},
        "learner_path": {"results", "picotron", "target", "world_size", "backend", "model", "revision"},
        # README.md's headline quotes only files of the tables in tables.HEADLINE, checked under their names.
        "headline": set()}
# A lent GPU machine runs every GPU benchmark through one script (its results come back from there).
GPU_SESSION = "OUT=DIR bash tools/gpu_session.sh"
MACHINE = {"platform", "cpus", "torch", "python"}


def _home(name: str) -> str:
    """The one markdown file that holds table `name`."""
    files = [file for file, text in tables.read_all().items() if f"<!-- table: {name} -->" in text]
    assert len(files) == 1, (name, files)
    return files[0]


def test_readme_and_docs_tables_equal_what_the_result_files_give():
    texts = tables.read_all()
    assert "README.md" in texts and any(file.startswith("docs/") for file in texts)
    assert tables.check(texts) == []
    assert tables.main(["--check"]) == 0


@pytest.mark.parametrize("name, column, sources", [
    ("zero_stages", 3, "benchmarks/results/zero_stages.json"),  # the first row's step time, e.g. " 661 "
    # the first row's result, e.g. " 0.987x eager, ...": a headline figure, from the results of several tables
    ("headline", 2, "benchmarks/results/throughput_gpu*.json, benchmarks/results/zero_stages_gpt2-124m*.json, "
                    "benchmarks/results/prepare_vs_peers.json, benchmarks/results/nanogpt_port.json, "
                    "benchmarks/results/ddp_modes.json, benchmarks/results/tensor_parallel_tp*.json, "
                    "benchmarks/results/multinode.json")])
def test_a_figure_edited_by_hand_is_caught(name, column, sources):
    file = _home(name)
    texts = tables.read_all()
    text = texts[file]
    block = tables.render(name)
    cell = block.splitlines()[2].split("|")[column]
    figure = re.search(r"\d", cell)
    typed = cell[:figure.start()] + str((int(figure.group()) + 1) % 10) + cell[figure.end():]
    edited = text.replace(block, block.replace(f"|{cell}|", f"|{typed}|", 1))
    assert edited != text
    message = f"{file}: table {name} differs from {sources}; run python benchmarks/tables.py"
    assert tables.stale(edited, file) == [message]
    assert tables.check({**texts, file: edited}) == [message]
    assert tables.generate(edited) == text


def test_every_headline_figure_is_one_of_its_full_tables():
    # A ratio, percentage, count or range in a row's result is written the same in the table that row links to.
    assert _home("headline") == "README.md"
    rows = tables.render("headline").splitlines()[2:2 + len(tables.HEADLINE)]
    checked = 0
    for name, row in zip(tables.HEADLINE, rows):
        _, measured, result, link, reproduce, _ = row.split("|")
        assert link.strip() == tables.HEADLINE[name] and f"({_home(name)}" in link  # the page that holds it
        full = tables.render(name)
        for figure in re.findall(r"\d+\.\d+(?: \[[\d.]+-[\d.]+\])?|\d+%|\d+/\d+", result):
            assert figure in full, (name, figure)
            checked += 1
        for command in re.findall(r"`([^`]+)`", reproduce):
            assert command in full, (name, command)  # its source line's
    assert checked >= len(tables.HEADLINE)


def test_every_table_sits_in_exactly_one_place_and_unknown_names_are_reported():
    texts = tables.read_all()
    assert sum(text.count("<!-- table: ") for text in texts.values()) == len(tables.TABLES)
    file = _home("zero_stages")
    block = next(m.group(0) for m in tables.BLOCK.finditer(texts[file]) if m.group(2) == "zero_stages")
    assert tables.check({**texts, file: texts[file].replace(block, "")}) == [
        f"no <!-- table: zero_stages --> block in {', '.join(texts)}"]
    assert tables.check({**texts, "README.md": texts["README.md"] + "\n" + block + "\n"}) == [
        f"table zero_stages appears 2 times, once is right: README.md, {file}"]
    unknown = "<!-- table: nonesuch -->\n| a |\n<!-- /table -->\n"
    problems = tables.check({**texts, "docs/extra.md": unknown})
    assert len(problems) == 1 and problems[0].startswith("docs/extra.md: unknown table 'nonesuch' (known: ")
    assert tables.generate(unknown) == unknown  # left alone: no renderer to write it


def test_every_result_file_belongs_to_a_table_and_has_its_keys():
    kinds = {}  # result file -> the tables that read it
    for name in tables.TABLES:
        for pattern in tables.globs(name):
            for path in tables.RESULTS.glob(pattern):
                kinds.setdefault(path, []).append(name)
    paths = sorted(tables.RESULTS.glob("*.json"))
    assert paths and set(paths) == set(kinds), "a result file no table reads"
    for path in paths:
        doc = json.loads(path.read_text())
        missing = set().union(*(KEYS[kind] for kind in kinds[path])) - doc.keys()
        assert not missing, f"{path.name} lacks {sorted(missing)}"
        # The headline quotes other tables' files only.
        assert kinds[path] != ["headline"], path.name
        # Older files recorded neither; a file that records one records both.
        assert ("command" in doc) == ("machine" in doc), path.name
        if "machine" in doc:
            assert doc["command"].startswith(("python benchmarks/", "python tools/chaos.py", GPU_SESSION)), path.name
            assert MACHINE <= doc["machine"].keys(), path.name


def test_the_source_line_never_invents_a_machine():
    old = {"path": "benchmarks/results/x.json"}
    new = {"path": "benchmarks/results/y.json", "command": "python benchmarks/y.py --steps 2",
           "machine": {"platform": "Linux", "processor": "Some CPU", "cpus": 2, "torch": "2.5", "python": "3.11.7"}}
    assert tables.source_line([old]) == "Source: `benchmarks/results/x.json` (command and machine not recorded)."
    assert tables.source_line([new, old]) == (
        "Source: `benchmarks/results/y.json` from `python benchmarks/y.py --steps 2` on Linux, Some CPU, 2 CPUs, "
        "torch 2.5, Python 3.11.7; `benchmarks/results/x.json` (command and machine not recorded).")
