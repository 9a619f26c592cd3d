"""`minitrain report`: the summary's numbers against the records they come from, the plots as readable
images, runs compared, and bad input refused before anything is written.

Most runs are hand-made metrics.jsonl files whose every value is known; one real training run checks that
the report reads what `minitrain train` writes and agrees with what the trainer itself printed.
"""
import contextlib
import io
import json
import math
import re
import statistics

import pytest
from matplotlib.image import imread

from minitrain.apps.cli import main
from minitrain.train.metrics import human_bytes, phase_line, phase_report
from minitrain.apps.report import metrics_path, unique_labels
from minitrain.apps.report_plots import OPTIONAL, PANELS

from tests.helpers.dist import run_cli

PNGS = [f"{name}.png" for name in PANELS if name not in OPTIONAL] + ["report.png"]  # a dense model's
VAL = {4: 3.0, 8: 2.5, 12: 2.75}  # step -> validation loss: the best is 2.5 at step 8


def step_record(step: int, loss: float, **changes) -> dict:
    """A step record shaped like the trainer's, 2 ranks, with values that vary from step to step."""
    step_time = 0.01 * (1 + step % 3)  # uneven, so that a median and a mean differ
    record = {
        "step": step, "loss": loss, "grad_norm": 1.0 + 0.1 * step, "param_norm": 10.0,
        "lr": 1e-3 * min(1.0, step / 3), "tokens": 128, "tokens_seen": 128 * step, "step_time_s": step_time,
        "tokens_per_s": 128 / step_time, "comm_time_s": step_time / 4, "comm_bytes": 1000, "comm_calls": 2,
        "param_norm_per_rank": [10.0, 10.0],
        "memory": {"params": [100, 100], "grads": [100, 100], "optimizer": [300, 300]},
        "memory_peak": {"params": [100, 100], "grads": [100, 100], "optimizer": [300, 300],
                        "total": [2**20 + 1024 * step, 2**21 + 512 * step], "device": [0, 0]},
        "sync": {}, "skipped": False, "loss_scale": None, "overflow": False, "pipeline": None,
        "phases_s": {"data": 0.001 * step, "forward": 0.003, "backward": 0.005, "forward_backward": None,
                     "comm": 0.002, "optimizer": 0.001, "other": 0.0005},
        "val_loss": VAL.get(step), "val_ppl": math.exp(VAL[step]) if step in VAL else None, "elapsed_s": 0.5 * step,
    }
    return {**record, **changes}


def write_run(run_dir, steps: int = 12, validation: bool = True) -> list[dict]:
    """A metrics.jsonl as a run with a rollback leaves it when it was not rewritten: steps 7 and 8 logged
    before the spike (loss 99), a rollback event, steps 7.. logged again, and a last line cut short by a
    crash. Step 3 was skipped. Returns the step records the report must use."""
    kept = [step_record(s, 4.0 - 0.1 * s, skipped=(s == 3)) for s in range(1, steps + 1)]
    if not validation:
        kept = [{k: v for k, v in r.items() if k not in ("val_loss", "val_ppl")} for r in kept]
    lines = [json.dumps(r) for r in kept[:6]]
    lines += [json.dumps({**r, "loss": 99.0}) for r in kept[6:8]]  # replaced when the steps are redone
    lines.append(json.dumps({"step": 6, "event": "rollback", "spike_step": 8, "loss": 99.0, "to_step": 6}))
    lines += [json.dumps(r) for r in kept[6:]]
    lines.append(json.dumps(step_record(steps + 1, 0.5))[:40])  # cut short by a crash
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return kept


def report(capsys, *argv: str):
    """`minitrain report ARGV...` in this process: exit code, stdout, stderr."""
    code = main(["report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def field(text: str, name: str) -> str:
    """The value on a summary row `  name   value` (the first run's, with several)."""
    for line in text.splitlines():
        if line.strip().startswith(name + "  "):
            return line.strip()[len(name):].strip()
    raise AssertionError(f"no row {name!r} in:\n{text}")


def assert_images(out_dir, names=PNGS):
    for name in names:
        image = imread(out_dir / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, (name, image.shape)


def tree(root) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def handmade(tmp_path_factory):
    """One report of a hand-made run, drawn once for the tests that read it (capsys is per test, so the
    output is captured by hand)."""
    root = tmp_path_factory.mktemp("report")
    kept = write_run(root / "alpha")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", str(root / "alpha"), "--out", str(root / "out")])
    return {"code": code, "out": out.getvalue(), "err": err.getvalue(), "kept": kept, "dir": root / "out"}


def test_summary_numbers_are_those_of_the_records(handmade):
    assert handmade["code"] == 0, handmade["err"]
    text, kept = handmade["out"], handmade["kept"]
    measured = kept[5:]  # the first 5 steps are warmup
    assert field(text, "steps") == "12 (step 1 to 12)"
    assert field(text, "tokens seen") == f"{128 * 12:,}"
    assert field(text, "final train loss") == f"{4.0 - 0.1 * 12:.4f}"  # the replayed step, not the spike's 99
    assert field(text, "best val loss") == f"2.5000 at step 8 (perplexity {math.exp(2.5):.2f})"
    median = statistics.median(r["tokens_per_s"] for r in measured)
    assert field(text, "tokens/s (median)").startswith(f"{median:,.0f} over steps 6-12")
    assert field(text, "mean step time") == f"{1000 * statistics.mean(r['step_time_s'] for r in measured):.1f} ms"
    phases = phase_report([r["phases_s"] for r in kept], warmup=min(5, len(kept) // 5))  # as the trainer does
    assert field(text, "where a step went") == phase_line(phases)
    assert field(text, "comm share").startswith("25.0% ")
    assert field(text, "peak memory") == (f"rank 0 {human_bytes(2**20 + 1024 * 12)}, "
                                          f"rank 1 {human_bytes(2**21 + 512 * 12)}")
    assert field(text, "skipped steps") == "1"
    assert field(text, "rollbacks") == "1"
    assert field(text, "elapsed").startswith("6.0 s ")
    assert field(text, "unreadable lines").startswith("1 ")


def test_every_plot_is_an_image_and_the_summary_is_saved(handmade):
    assert_images(handmade["dir"])
    saved = (handmade["dir"] / "summary.txt").read_text()
    assert saved and handmade["out"].startswith(saved)
    assert "left out for lack of data" not in handmade["out"]


def test_a_run_without_validation_reports_in_its_own_directory(tmp_path, capsys):
    write_run(tmp_path / "plain", steps=4, validation=False)
    code, out, err = report(capsys, str(tmp_path / "plain"))
    assert code == 0, err
    assert field(out, "best val loss") == "no validation"
    # Too few steps to leave warmup out: every step counts.
    assert field(out, "tokens/s (median)").startswith(
        f"{statistics.median(128 / (0.01 * (1 + s % 3)) for s in range(1, 5)):,.0f} over all steps")
    assert_images(tmp_path / "plain" / "report")


def test_a_quantity_no_run_recorded_is_left_out(tmp_path, capsys):
    write_run(tmp_path / "old")
    path = tmp_path / "old" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "memory_peak"}) + "\n"
                            for r in records))
    code, out, err = report(capsys, str(tmp_path / "old"), "--out", str(tmp_path / "out"))
    assert code == 0, err
    assert "left out for lack of data: memory.png" in out and field(out, "peak memory") == "not recorded"
    assert not (tmp_path / "out" / "memory.png").exists()
    assert_images(tmp_path / "out", [name for name in PNGS if name != "memory.png"])


def test_a_real_run_compared_with_another(tmp_path, capsys):
    trained = run_cli("train", "--nproc", "2", "--steps", "6", "--eval.every", "3", "--eval.batches", "2",
                      "--out", str(tmp_path / "real"))
    assert trained.returncode == 0, trained.stderr
    records = [json.loads(line) for line in (tmp_path / "real" / "metrics.jsonl").read_text().splitlines()]
    val_loss, val_step = min((r["val_loss"], r["step"]) for r in records if r.get("val_loss") is not None)
    write_run(tmp_path / "handmade")
    code, out, err = report(capsys, str(tmp_path / "real"), str(tmp_path / "handmade"), "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    # The report reads the trainer's file as the trainer summarised it.
    final = re.search(r"final loss ([0-9.]+)", trained.stdout).group(1)
    assert field(out, "final train loss") == final
    phases = re.search(r"where a step went \(rank 0, after warmup\): (.*)", trained.stdout).group(1)
    assert field(out, "where a step went") == phases
    assert field(out, "best val loss").startswith(f"{val_loss:.4f} at step {val_step} ")
    table = out.split("comparison")[1].splitlines()
    assert table[1].split()[0] == "run" and [row.split()[0] for row in table[3:5]] == ["real", "handmade"]
    assert_images(tmp_path / "cmp")


def test_runs_named_alike_get_unique_labels_and_share_runs_report(tmp_path, capsys, monkeypatch):
    write_run(tmp_path / "x" / "run", steps=6)
    write_run(tmp_path / "y" / "run", steps=6, validation=False)
    monkeypatch.chdir(tmp_path)  # several runs: the default --out is runs/report under the working directory
    code, out, err = report(capsys, "x/run", "y/run")
    assert code == 0, err
    assert "run x/run (" in out and "run y/run (" in out
    rows = out.split("comparison")[1].splitlines()[3:5]
    assert [row.split()[0] for row in rows] == ["x/run", "y/run"]
    assert rows[0].split()[4:6] == ["3.0000", "@4"]  # the one validation in 6 steps
    assert rows[1].split()[4] == "-"
    assert_images(tmp_path / "runs" / "report")


def test_labels_are_directory_names_made_unique(tmp_path):
    paths = [tmp_path / d / "metrics.jsonl" for d in ("a/run", "b/run", "c", "c")]
    assert unique_labels(paths) == ["a/run", "b/run", "c", "c #2"]


def test_a_run_is_named_by_its_directory_or_its_metrics_file(tmp_path):
    write_run(tmp_path / "r", steps=2)
    assert metrics_path(str(tmp_path / "r")) == metrics_path(str(tmp_path / "r" / "metrics.jsonl"))


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("empty_dir", "holds no metrics.jsonl"),
    ("no_steps", "holds no step records"),
    ("out_under_a_file", "is a file, not a directory"),
    ("second_run_missing", "does not exist"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, case, message):
    monkeypatch.chdir(tmp_path)  # a default --out would land here, and be seen
    write_run(tmp_path / "good", steps=3)
    (tmp_path / "empty").mkdir()
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "metrics.jsonl").write_text('{"step": 2, "event": "rollback"}\n{"step": 3, "lo\n')
    argv = {"missing": ["nowhere"], "empty_dir": ["empty"], "no_steps": ["events"],
            "out_under_a_file": ["good", "--out", "good/metrics.jsonl/report"],
            "second_run_missing": ["good", "nowhere"]}[case]
    before = tree(tmp_path)
    code, out, err = report(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minitrain report: error: ") and message in lines[0], err
    assert tree(tmp_path) == before


def test_help_teaches_by_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["report", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "Examples:" in text and "minitrain report runs/a" in text and "RUN_DIR" in text

