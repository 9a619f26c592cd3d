import json

import pytest

from tests.helpers.dist import run_cli, run_main

pytestmark = pytest.mark.slow

METRIC_KEYS = {"step", "loss", "grad_norm", "param_norm", "lr", "tokens", "step_time_s", "tokens_per_s",
               "comm_time_s", "comm_bytes", "memory"}


@pytest.mark.parametrize("argv, message", [
    (["train", "--preset", "huge"], "unknown preset 'huge'"),
    (["train", "--model.n_head", "5"], "does not divide"),
    (["train", "--nproc", "0"], "world size must be at least 1"),
    (["train", "--steps", "ten"], "invalid int value: 'ten'"),
    (["train", "--resume", "no/such/dir"], "does not exist"),
    (["train", "--out", "/proc/no-such-dir/x"], "cannot write to output directory"),
    (["demo", "--world-size", "0"], "world size must be at least 1"),
    (["train", "--spike-factor", "0.5"], "train.spike_factor must be > 1 (or 0"),
    (["train", "--fault.kind", "meteor"], "fault.kind must be one of"),
    (["train", "--nproc", "2", "--fault.kind", "sigkill", "--fault.step", "3", "--fault.rank", "2"],
     "fault.rank 2 is not a rank of this run (world size 2)"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, argv, message):
    result = run_main(*argv, cwd=tmp_path)  # refused before any rank starts (the exit status of the
    # real command is covered by test_the_command_exits_2_on_bad_input below)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_command_exits_2_on_bad_input(tmp_path):
    for argv in (["train", "--model.n_head", "5"], ["train", "--steps", "ten"]):  # a ConfigError, a usage error
        result = run_cli(*argv, cwd=tmp_path)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_resume_that_does_not_fit_is_refused_in_one_line(tmp_path):
    assert run_cli("train", "--steps", "2", "--ckpt-every-steps", "2", "--out", "a", cwd=tmp_path).returncode == 0
    for argv, message in ((["--batch-size", "2"], "keep the product equal (e.g. --batch-size 4"),
                          (["--seed", "3"], "use the same seed"),
                          (["--model.n_layer", "3"], "different model: n_layer=2 (this run 3)"),
                          (["--steps", "2"], "ask for more --steps")):
        result = run_main("train", "--steps", "4", "--resume", "a", "--out", "b", *argv, cwd=tmp_path)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    result = run_cli("train", "--steps", "3", "--lr", "0.001", "--resume", "a", "--out", "b", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warm restart" in result.stderr and "steps 2 -> 3" in result.stderr and "lr 0.003 -> 0.001" in result.stderr
    shard = tmp_path / "a/checkpoints/step-000002/rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = run_main("train", "--steps", "4", "--resume", "a", "--out", "c", cwd=tmp_path)
    assert result.returncode == 2 and "rank-00000.safetensors is corrupt" in result.stderr
    assert not (tmp_path / "c").exists()


def test_demo_refuses_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/notes.txt").write_text("keep me")
    result = run_cli("demo", "--out", "mine", cwd=tmp_path)
    assert result.returncode == 2 and "not written by `minitrain demo`" in result.stderr
    assert (tmp_path / "mine/notes.txt").read_text() == "keep me"


def test_train_writes_metrics_and_checkpoints_then_resumes(tmp_path):
    result = run_cli("train", "--nproc", "2", "--zero", "1", "--steps", "4", "--ckpt-every-steps", "2",
                     "--out", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "step 4/4" in result.stdout and "done: 4 steps on 2 rank(s)" in result.stdout
    lines = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and METRIC_KEYS <= set(lines[0])
    assert set(lines[0]["memory"]) == {"params", "grads", "optimizer"} and len(lines[0]["memory"]["optimizer"]) == 2
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["latest", "step-000002", "step-000004"]

    result = run_cli("train", "--nproc", "2", "--zero", "1", "--steps", "6", "--resume", "auto", "--out", "run",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "resumed from run/checkpoints/step-000004 at step 4" in result.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_measure_sync_switch_reports_distributions(tmp_path):
    result = run_cli("train", "--nproc", "2", "--steps", "6", "--measure-sync", "--bucket-mb", "0.02",
                     "--train.log_every", "0", "--out", "ms", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "gradient sync after warmup: allreduce_inflight_ms mean" in result.stdout and "overlap mean" in result.stdout
    last = json.loads((tmp_path / "ms/metrics.jsonl").read_text().splitlines()[-1])["sync"]
    assert last["buckets"] == last["allreduce_calls"] > 1 and last["sync_exposed_s"] >= 0
    assert 0 <= last["overlap"] <= 1 and last["compute_and_sync_s"] > 0


def test_config_file_and_flags(tmp_path):
    (tmp_path / "run.toml").write_text('out = "from-file"\n[train]\nsteps = 2\nlr = 0.001\n[model]\nn_layer = 1\n')
    result = run_cli("train", "--config", "run.toml", "--train.log_every", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "done: 2 steps" in result.stdout and (tmp_path / "from-file/metrics.jsonl").exists()


def test_runs_under_torchrun(tmp_path):
    result = run_cli("train", "--zero", "1", "--steps", "3", "--out", "tr", cwd=tmp_path, torchrun_nproc=2)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done: 3 steps on 2 rank(s)") == 1  # rank 0 speaks
    assert len((tmp_path / "tr/metrics.jsonl").read_text().splitlines()) == 3


def test_help_teaches():
    out = run_main("train", "--help").stdout
    for flag in ("--preset", "--nproc", "--steps", "--seed", "--batch-size", "--lr", "--zero",
                 "--ckpt-every-steps", "--resume", "--out", "--config", "--model.d_model", "torchrun"):
        assert flag in out
