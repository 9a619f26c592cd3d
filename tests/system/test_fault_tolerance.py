"""A run survives a killed rank, a killed save, a failed write and a scheduler's signal, and
ends bit-identical to the run nothing happened to.

Every scenario trains the tiny model on 2 ranks for 20 steps with a checkpoint every 5, and
is compared file for file (whole safetensors shards: parameters, optimizer state and every
rank's random-generator states) with one uninterrupted run of the same settings.
"""
import json
import signal

import pytest

from minitrain import checkpoint

from tests.helpers.dist import run_cli, run_cli_and_signal

pytestmark = pytest.mark.slow

RUN = ("train", "--steps", "20", "--ckpt-every-steps", "5", "--train.log_every", "0")


def _shards(out, step=20) -> dict[str, bytes]:
    step_dir = out / "checkpoints" / checkpoint.step_dir_name(step)
    files = {f.name: f.read_bytes() for f in sorted(step_dir.glob("rank-*.safetensors"))}
    assert len(files) == 2, f"{step_dir} holds {sorted(files)}"
    return files


def _latest(out) -> str:
    return (out / "checkpoints" / "latest").read_text().strip()


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's checkpoints at steps 5, 10, 15 and 20."""
    out = tmp_path_factory.mktemp("reference")
    _ok(run_cli(*RUN, "--nproc", "2", "--out", str(out)))
    return {step: _shards(out, step) for step in (5, 10, 15, 20)}


def test_sigkill_under_torchrun_restarts_from_the_last_checkpoint_bit_identical(tmp_path, reference):
    # Rank 1 dies (SIGKILL) as step 7 starts; torchrun restarts both ranks, which resume from step 5
    # (a restarted attempt resumes by itself: no --resume needed). Twice: a restart race once failed about
    # half the time (benchmarks/torchrun_restarts.py measures it over 10 trials).
    for attempt in range(2):
        out = tmp_path / f"attempt{attempt}"
        proc = _ok(run_cli(*RUN, "--out", str(out), "--fault.kind", "sigkill",
                           "--fault.step", "7", "--fault.rank", "1", torchrun_nproc=2,
                           torchrun_args=("--max-restarts=1",), timeout_s=120))
        assert "(exitcode: -9) local_rank: 1" in proc.stderr  # torchrun saw rank 1 killed, and restarted
        assert "step-000005 at step 5" in proc.stdout, proc.stdout
        assert _shards(out) == reference[20], f"attempt {attempt}: final state differs from the uninterrupted run"


def test_kill_during_save_leaves_the_previous_checkpoint_and_resume_is_bit_identical(tmp_path, reference):
    out = tmp_path / "run"
    # Rank 0 is SIGKILLed in the step-10 save, after writing its shard file, before the rename.
    killed = run_cli(*RUN, "--nproc", "2", "--out", str(out), "--fault.kind", "kill-in-save",
                     "--fault.step", "10", "--fault.rank", "0")
    assert killed.returncode == 1 and "rank 0 failed" in killed.stderr and "SIGKILL" in killed.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / ".tmp-step-000010" / "rank-00000.safetensors").is_file()  # some shard files made it
    assert not (ckpts / "step-000010").exists() and _latest(out) == "step-000005"
    assert checkpoint.find_latest(out) == ckpts / "step-000005"  # the half-written save is no checkpoint

    resumed = _ok(run_cli(*RUN, "--nproc", "2", "--out", str(out), "--resume", "auto"))
    assert "step-000005 at step 5" in resumed.stdout
    assert _shards(out) == reference[20]
    assert not list(ckpts.glob(".tmp-*"))  # swept by the next save


def test_sigterm_on_one_rank_saves_everywhere_exits_zero_and_resumes_bit_identical(tmp_path, reference):
    out = tmp_path / "run"
    stopped = _ok(run_cli(*RUN, "--nproc", "2", "--out", str(out), "--fault.kind", "sigterm",
                          "--fault.step", "7", "--fault.rank", "1"))
    assert "SIGTERM received by rank [1]: stopped after step 7" in stopped.stdout
    assert "done: 7 steps (stopped by SIGTERM)" in stopped.stdout
    assert _latest(out) == "step-000007"
    checkpoint.verify(out / "checkpoints" / "step-000007")  # complete: manifest and every sha256
    _ok(run_cli(*RUN, "--nproc", "2", "--out", str(out), "--resume", "auto"))
    assert _shards(out) == reference[20]


def test_a_ctrl_c_saves_and_the_run_resumes_bit_identically(tmp_path, reference):
    """Ctrl-C in the terminal (SIGINT to the whole process group) used to lose every step since the last save."""
    out = tmp_path / "run"
    proc = run_cli_and_signal(*RUN[:-2], "--train.log_every", "1", "--nproc", "2", "--out", str(out),
                              signum=signal.SIGINT, after_line=" 6/20 ", to_group=True)
    assert proc.returncode == 0, proc.stderr
    assert "SIGINT received by rank [0, 1]" in proc.stdout and "Ctrl-C again" in proc.stderr
    step = checkpoint.verify(out / "checkpoints")[1]["step"]
    assert 6 <= step < 20
    _ok(run_cli(*RUN, "--nproc", "2", "--out", str(out), "--resume", "auto"))
    assert _shards(out) == reference[20]


def test_a_second_ctrl_c_stops_at_once_saying_what_is_lost(tmp_path):
    out = tmp_path / "run"
    proc = run_cli_and_signal("train", "--nproc", "2", "--steps", "1000", "--ckpt-every-steps", "2", "--out",
                              str(out), "--fault.kind", "slow", "--fault.step", "4", "--fault.slow_s", "3",
                              signum=signal.SIGINT, after_line=" 4/1000 ", to_group=True, again_after_s=1.5)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert "interrupted at once: what was trained after" in proc.stderr and "step-000004" in proc.stderr
    assert _latest(out) == "step-000004"  # the interrupted save never happened; the earlier one is intact


def test_sigusr1_to_the_launcher_reaches_every_rank(tmp_path):
    out = tmp_path / "run"
    proc = run_cli_and_signal("train", "--nproc", "2", "--steps", "100000", "--out", str(out),
                              signum=signal.SIGUSR1, after_line=" 5/100000 ")
    assert proc.returncode == 0, proc.stderr
    assert "SIGUSR1 received by rank [0, 1]" in proc.stdout
    step = checkpoint.verify(out / "checkpoints")[1]["step"]
    assert 5 <= step < 100000 and _latest(out) == checkpoint.step_dir_name(step)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP"])
def test_a_stop_signal_to_the_whole_process_group_still_saves(tmp_path, signum):
    # The launcher, its fork server and every rank get the signal at once; the ranks agree on a step,
    # save it and exit 0, and nothing half-written is left.
    out = tmp_path / "run"
    proc = run_cli_and_signal("train", "--nproc", "2", "--steps", "100000", "--ckpt-every-steps", "50",
                              "--out", str(out), signum=signum, after_line=" 5/100000 ", to_group=True)
    assert proc.returncode == 0, proc.stderr
    assert f"{signal.Signals(signum).name} received by rank [0, 1]" in proc.stdout
    step = checkpoint.verify(out / "checkpoints")[1]["step"]
    assert 5 <= step < 50 and _latest(out) == checkpoint.step_dir_name(step)
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_failed_shard_write_fails_the_run_naming_rank_and_step(tmp_path, background):
    out = tmp_path / "run"
    proc = run_cli(*RUN, "--nproc", "2", "--out", str(out), "--fault.kind", "save-error",
                   "--fault.step", "10", "--fault.rank", "1", *(["--async-save"] if background else []))
    assert proc.returncode == 1
    assert "rank 1 failed" in proc.stderr and "step 10: writing" in proc.stderr
    assert "injected write failure" in proc.stderr and "`latest` still names the previous checkpoint" in proc.stderr
    assert _latest(out) == "step-000005" and not (out / "checkpoints" / "step-000010").exists()


def test_async_save_writes_the_same_checkpoints_as_a_blocking_save(tmp_path, reference):
    out = tmp_path / "run"
    _ok(run_cli(*RUN, "--nproc", "2", "--out", str(out), "--async-save"))
    for step in (5, 10, 15, 20):
        assert _shards(out, step) == reference[step], f"step {step}"
        manifest = json.loads((out / "checkpoints" / checkpoint.step_dir_name(step) / "manifest.json").read_text())
        assert manifest["config"]["ckpt"]["async_save"] is True
    assert _latest(out) == "step-000020"


def test_an_offload_file_truncated_mid_run_stops_it_in_one_line_and_resume_is_bit_identical(tmp_path, reference):
    # Rank 1's disk-offload files are cut to half as step 7 starts (another program in the offload directory):
    # reading them through their mapping would end the process with SIGBUS; the step says which file, exit 2, one
    # line. The step-5 checkpoint is untouched, no offload file is left, and the resumed run (offload on again,
    # its files made fresh) ends bit-identical to the uninterrupted run without offload.
    out = tmp_path / "run"
    offload = ("--train.offload", "disk")
    cut = run_cli(*RUN, *offload, "--nproc", "2", "--out", str(out), "--fault.kind", "truncate-offload",
                  "--fault.step", "7", "--fault.rank", "1")
    assert cut.returncode == 2, cut.stderr
    lines = cut.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank 1: offload:" in lines[0] and "rank-00001-" in lines[0], cut.stderr
    assert "was truncated to" in lines[0] and "resume from the last checkpoint" in lines[0]
    assert _latest(out) == "step-000005" and checkpoint.find_latest(out) == out / "checkpoints" / "step-000005"
    assert not (out / "offload").exists()

    resumed = _ok(run_cli(*RUN, *offload, "--nproc", "2", "--out", str(out), "--resume", "auto"))
    assert "step-000005 at step 5" in resumed.stdout
    assert _shards(out) == reference[20]
