"""A resume continues the same run or says why not: another corpus is refused, changed optimizer settings
are a warm restart said in a note, a finished run is done (exit 0), an --out holding a run is never
silently overwritten, a `latest` that leads nowhere never means "start over", and two runs cannot write
one --out at once."""
import fcntl
import shutil
from pathlib import Path

import pytest

from minitrain.config import ConfigError

from minitrain.train.run_config import run_config
from minitrain.train.resume import check_resume

from tests.helpers.dist import run_cli, run_main

STEPS = 4
RUN = ("--steps", str(STEPS), "--ckpt-every-steps", "2", "--train.log_every", "0")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = run_cli("train", *RUN, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of a finished 1-rank run (checkpoints at steps 2 and 4, metrics for 4 steps)."""
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def _files(out: Path) -> dict:
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".lock"}


def _refused(proc, message: str) -> None:
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_resuming_on_another_corpus_is_refused(run):
    before = _files(run)
    proc = run_main("train", *RUN, "--steps", "6", "--resume", "auto", "--out", str(run), "--data.corpus_seed", "1")
    _refused(proc, "was trained on another corpus (sha256 ")
    assert _files(run) == before


def test_changed_optimizer_settings_resume_as_a_warm_restart_said_in_a_note(run):
    values = {"ckpt.resume": "auto", "out": str(run), "train.steps": 6, "train.grad_accum": 2,
              "train.weight_decay": 0.0, "train.beta2": 0.99, "train.grad_clip": 0.5}
    notes = check_resume(run_config(cli_values=values))
    assert len(notes) == 1 and "warm restart" in notes[0]
    for change in ("steps 4 -> 6", "grad_accum 1 -> 2", "weight_decay 0.1 -> 0.0", "beta2 0.95 -> 0.99",
                   "grad_clip 1.0 -> 0.5"):
        assert change in notes[0], notes[0]


def test_resume_auto_on_a_finished_run_says_so_and_exits_0(run):
    before = _files(run)
    proc = run_main("train", *RUN, "--resume", "auto", "--out", str(run))
    assert proc.returncode == 0 and "already finished" in proc.stdout and "step 4 of --steps 4" in proc.stdout
    assert _files(run) == before


def test_an_out_dir_holding_a_run_is_not_reused_without_resume(run):
    before = _files(run)
    _refused(run_main("train", *RUN, "--out", str(run)), "already holds a run (metrics.jsonl and checkpoints)")
    assert _files(run) == before


def test_a_latest_that_leads_nowhere_never_starts_the_run_over(run):
    checkpoints = run / "checkpoints"
    for step_dir in checkpoints.glob("step-*"):
        shutil.rmtree(step_dir)
    before = _files(run)
    proc = run_main("train", *RUN, "--steps", "6", "--resume", "auto", "--out", str(run))
    assert proc.returncode == 2 and "no checkpoint under" in proc.stderr and "move" in proc.stderr, proc.stderr
    assert _files(run) == before  # metrics.jsonl keeps its 4 lines


def test_two_runs_on_one_out_dir_are_prevented(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running minitrain holds it
        held.write("pid 12345\n")
        held.flush()
        _refused(run_main("train", *RUN, "--out", str(out)), "is in use by another minitrain run (pid 12345)")
    assert not (out / "metrics.jsonl").exists()


def test_settings_that_do_not_fit_fail_before_the_lock_or_any_file(tmp_path):
    with pytest.raises(ConfigError):
        run_config(cli_values={"train.lr": "nan"})
    _refused(run_main("train", "--lr", "nan", "--out", str(tmp_path / "x")), "train.lr must be a finite number")
    assert not (tmp_path / "x").exists()


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    from minitrain import checkpoint

    for step in (999_999, 1_000_000, 5):
        d = tmp_path / checkpoint.step_dir_name(step)
        d.mkdir()
        (d / "manifest.json").write_text("{}")
    assert [checkpoint.step_of(d) for d in checkpoint.complete_steps(tmp_path)] == [1_000_000, 999_999, 5]


def test_a_latest_symlink_is_refused_without_showing_what_it_points_at(run, tmp_path):
    from minitrain import checkpoint

    secret = tmp_path / "secret"
    secret.write_text("password123\n")
    latest = run / "checkpoints" / "latest"
    latest.unlink()
    latest.symlink_to(secret)
    with pytest.raises(checkpoint.CheckpointError, match="is a symlink") as refused:
        checkpoint.resolve(run / "checkpoints")
    assert "password123" not in str(refused.value)


def test_consolidating_into_the_checkpoint_itself_is_refused(run):
    step_dir = run / "checkpoints" / "step-000004"
    before = _files(run)
    proc = run_main("ckpt", "consolidate", str(step_dir), str(step_dir / "rank-00000.safetensors"))
    assert proc.returncode == 2 and "is inside the checkpoint" in proc.stderr, proc.stderr
    assert _files(run) == before


@pytest.mark.parametrize("argv,message", [
    (["--out", ""], "--out is empty"),
    (["--corpus", "odd.bin"], "has an odd number of bytes (5)"),
])
def test_an_empty_out_and_an_odd_length_corpus_are_refused(tmp_path, argv, message):
    (tmp_path / "odd.bin").write_bytes(b"abcde")
    proc = run_main("train", *argv, cwd=tmp_path)
    _refused(proc, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.bin"]


def test_keep_last_after_resuming_from_an_older_step_drops_the_abandoned_line(run):
    proc = run_cli("train", "--steps", "3", "--ckpt-every-steps", "2", "--keep-last", "1", "--train.log_every", "0",
                    "--resume", str(run / "checkpoints" / "step-000002"), "--out", str(run))
    assert proc.returncode == 0, proc.stderr
    # step-000004 was the newest, but of the line this run left at step 2: kept, it would be "the newest"
    # and --keep-last 1 would delete this run's own checkpoints instead.
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000003"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"


@pytest.mark.multirank
def test_the_lock_is_released_when_the_run_ends(tmp_path):
    out = tmp_path / "run"
    # In this process, as a notebook would (the launcher's ranks are bounded by pytest's --timeout here).
    assert run_main("train", *RUN, "--out", str(out)).returncode == 0
    proc = run_main("train", *RUN, "--steps", "6", "--resume", "auto", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
