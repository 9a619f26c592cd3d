import json

from safetensors.torch import load_file

from .dist import run_cli

MANIFEST_KEYS = {"seed", "backend", "world_size", "model_params", "steps", "allreduce_p50_ms", "allreduce_p95_ms",
                 "tokens_per_sec_1proc", "tokens_per_sec_2proc", "byte_equivalent", "lesson_notes"}


def test_bench_scaling_writes_its_outputs(tmp_path):
    result = run_cli("bench", "scaling", "--steps", "12", "--out", "sc", cwd=tmp_path, timeout_s=120)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "sc"
    manifest = json.loads((out / "manifest.json").read_text())
    assert MANIFEST_KEYS <= set(manifest)
    assert manifest["seed"] == 35000 and manifest["backend"] == "gloo" and manifest["world_size"] == 2
    assert manifest["model_params"] == 30080 and manifest["steps"] == 12
    assert manifest["byte_equivalent"] == {"equal": True, "max_abs_diff": 0.0, "ranks_compared": 2, "world_size": 2}
    assert 0 < manifest["allreduce_p50_ms"] <= manifest["allreduce_p95_ms"]
    # The paragraph is written from the measured numbers.
    notes = manifest["lesson_notes"]
    assert f"{manifest['tokens_per_sec_2proc']:,.0f} tokens/s" in notes and "all-reduce" in notes
    rows = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert {(r["world_size"], r["rank"]) for r in rows} == {(1, 0), (2, 0), (2, 1)} and len(rows) == 36
    assert all(r["sync_exposed_s"] is not None for r in rows if r["bracketed"])
    states = [load_file(str(out / f"state-rank-{r}.safetensors")) for r in range(2)]
    assert set(states[0]) == {"params", "optim.master", "optim.exp_avg", "optim.exp_avg_sq"}
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_scaling_rejects_a_single_process():
    result = run_cli("bench", "scaling", "--max-procs", "1")
    assert result.returncode == 2 and "--max-procs: invalid choice: 1 (choose from 2, 4)" in result.stderr
