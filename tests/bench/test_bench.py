import json

import pytest
from safetensors.torch import load_file

from tests.helpers.dist import run_cli, run_main

pytestmark = pytest.mark.slow

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
    result = run_main("bench", "scaling", "--max-procs", "1")
    assert result.returncode == 2 and "--max-procs: invalid choice: 1 (choose from 2, 4)" in result.stderr


def test_bench_comm_reports_bandwidths_as_nccl_tests_define_them_and_a_fit(tmp_path):
    # Up to 4 MiB: at 1 MiB the time per byte is small against this machine's scheduling noise (a call's latency
    # here varies by milliseconds), and a noisy run once fitted a slope of zero (beta = inf).
    result = run_cli("bench", "comm", "--nproc", "2", "--max-mb", "4", "--out", "bc", cwd=tmp_path, timeout_s=120)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "bc" / "comm.json").read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    factors = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0, "all_to_all": 0.5}
    assert set(report["ops"]) == set(factors)
    for op, r in report["ops"].items():
        assert r["sizes_bytes"] == [1024 * 4**i for i in range(7)] and r["busbw_factor"] == factors[op]  # 2(N-1)/N
        for s, t, alg, bus in zip(r["sizes_bytes"], r["time_s"], r["algbw_Bps"], r["busbw_Bps"]):
            assert t > 0 and alg == s / t and bus == alg * factors[op]
        assert r["alpha_s"] > 0 and 0 < r["beta_Bps"] < float("inf"), (op, r["alpha_s"], r["beta_Bps"])
        assert r["fit_time_s"][0] < r["fit_time_s"][-1]  # 4 MiB takes longer than 1 KiB, in the model too
    assert (tmp_path / "bc" / "comm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "alpha-beta fit" in result.stdout


def test_fit_recovers_a_known_alpha_and_beta():
    from minitrain.bench.comm import fit_alpha_beta

    sizes = [1024 * 4**i for i in range(9)]
    times = [50e-6 + 1.5 * s / 2e9 for s in sizes]  # alpha 50 us, beta 2 GB/s, factor 1.5
    alpha, beta = fit_alpha_beta(sizes, times, 1.5)
    assert abs(alpha - 50e-6) < 1e-12 and abs(beta - 2e9) / 2e9 < 1e-9


def test_bench_comm_refuses_one_rank(tmp_path):
    result = run_main("bench", "comm", "--nproc", "1", "--out", "x", cwd=tmp_path)
    assert result.returncode == 2 and "needs at least 2 ranks" in result.stderr and not (tmp_path / "x").exists()


def test_bench_throughput_measures_both_loops_and_writes_its_json(tmp_path):
    result = run_cli("bench", "throughput", "--preset", "tiny", "--precision", "fp32", "bf16", "--steps", "3",
                     "--rounds", "2", "--warmup", "1", "--out", "tp", cwd=tmp_path, timeout_s=120)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "tp" / "throughput.json").read_text())
    assert report["device"].startswith("CPU") and [c["precision"] for c in report["configs"]] == ["fp32", "bf16"]
    for c in report["configs"]:
        assert c["tokens_per_s"] > 0 and c["plain_tokens_per_s"] > 0 and len(c["rounds"]) == 2
        ratios = sorted(r["ours"] / r["plain"] for r in c["rounds"])
        assert abs(c["ratio"] - (ratios[0] + ratios[1]) / 2) < 1e-12  # the median of two rounds
        # MFU is tokens/s x (6N + 12 L h T) over the measured peak; tiny: N = 30,080, L = 2, h = 32, T = 16.
        assert c["flops_per_token"] == 6 * 30_080 + 12 * 2 * 32 * 16 and c["peak_source"].startswith("measured")
        assert abs(c["mfu"] - c["tokens_per_s"] * c["flops_per_token"] / c["peak_flops"]) < 1e-12
    assert "ours/plain" in result.stdout and "MFU" in result.stdout


def test_bench_throughput_refuses_bad_input():
    result = run_main("bench", "throughput", "--precision", "fp16")
    assert result.returncode == 2 and "--precision 'fp16': choose from fp32, bf16" in result.stderr
    result = run_main("bench", "throughput", "--steps", "0")
    assert result.returncode == 2 and "--steps must be at least 1, got 0" in result.stderr
