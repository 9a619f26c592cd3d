"""From text to a model a person uses, as a user runs it: `data prepare` on the shipped prose, `train` on 2
ranks with validation and TensorBoard, `export`, `sample`, `report`; and the refusals of the new commands."""
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minitrain
from minitrain.apps.cli import main
from minitrain.train.run_config import run_config
from minitrain.data import load_val
from minitrain.models.minigpt.model import MiniGPT
from minitrain.runtime.topology import Topology
from minitrain.train.trainer import Trainer, seed_everything

from tests.helpers.dist import run_cli, run_ranks

pytestmark = pytest.mark.slow

NOTES = Path(minitrain.__file__).parent / "corpora" / "field_notes.txt"
STEPS, EVAL_EVERY = 60, 20
MODEL = ["--model.n_layer", "2", "--model.d_model", "64", "--model.seq_len", "64"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One prepared corpus, one 2-rank run with validation and TensorBoard, one export."""
    root = tmp_path_factory.mktemp("workflow")
    assert main(["data", "prepare", str(NOTES), "--vocab-size", "512", "--out", str(root / "notes")]) == 0
    run = run_cli("train", "--nproc", "2", "--corpus", str(root / "notes"), *MODEL, "--batch-size", "8",
                  "--steps", str(STEPS), "--lr", "1e-2", "--eval-every", str(EVAL_EVERY), "--eval-batches", "4",
                  "--log.tensorboard", "--out", str(root / "run"), timeout_s=180)
    assert run.returncode == 0, run.stderr
    assert main(["export", str(root / "run"), str(root / "model")]) == 0
    return root, run


def _steps(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "event" not in line]


def test_validation_beats_the_unigram_entropy_and_is_reported(trained):
    root, run = trained
    steps = _steps(root / "run")
    evaluated = [s for s in steps if s["val_loss"] is not None]
    assert [s["step"] for s in evaluated] == [20, 40, 60]
    assert all(s["val_ppl"] == pytest.approx(math.exp(s["val_loss"]), rel=1e-12) for s in evaluated)
    val = np.concatenate([np.fromfile(path, dtype=np.uint16) for path in sorted((root / "notes").glob("val-*.bin"))])
    p = np.bincount(val) / len(val)
    unigram = float(-(p[p > 0] * np.log(p[p > 0])).sum())  # what a model that ignores context could reach
    best = min(evaluated, key=lambda s: s["val_loss"])
    assert best["val_loss"] < unigram - 0.1, (best["val_loss"], unigram)
    assert f"val {best['val_loss']:.4f} (ppl {best['val_ppl']:.1f})" in run.stdout  # in the progress line
    assert f"best val loss {best['val_loss']:.4f} (ppl {best['val_ppl']:.1f}) at step {best['step']}" in run.stdout
    assert all(s["elapsed_s"] > 0 for s in steps) and " eta 0:00:00" in run.stdout
    # The model takes the corpus's vocabulary; the run records its settings, environment and tokenizer.
    config = json.loads((root / "run" / "config.json").read_text())
    assert config["model"]["vocab_size"] == 512 and config["eval"]["every"] == EVAL_EVERY
    env = json.loads((root / "run" / "env.json").read_text())
    assert env["world_size"] == 2 and env["backend"] == "gloo" and env["versions"]["torch"] == torch.__version__
    assert (root / "run" / "tokenizer.json").read_bytes() == (root / "notes" / "tokenizer.json").read_bytes()
    assert (root / "run" / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:06d}"  # the final save


def test_tensorboard_holds_what_metrics_jsonl_holds(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = trained
    events = EventAccumulator(str(root / "run" / "tensorboard"))
    events.Reload()
    steps = _steps(root / "run")
    pairs = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "val/loss": "val_loss",
             "train/tokens_per_s": "tokens_per_s", "train/comm_time_s": "comm_time_s"}
    for tag, field in pairs.items():
        expected = [(s["step"], s[field]) for s in steps if s[field] is not None]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [step for step, _ in got] == [step for step, _ in expected], tag
        assert np.allclose([v for _, v in got], [v for _, v in expected], rtol=1e-6), tag  # stored as float32
    memory = [(e.step, e.value) for e in events.Scalars("memory/peak_bytes_max_rank")]
    assert memory == [(s["step"], float(max(s["memory_peak"]["total"]))) for s in steps]


def test_the_export_is_all_sample_needs_and_a_seed_gives_the_same_text(trained, tmp_path, capsys):
    root, _ = trained
    alone = tmp_path / "model"
    shutil.copytree(root / "model", alone)  # nothing else of the run comes along
    assert sorted(p.name for p in alone.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    texts = []
    for seed in (1, 1, 2):
        capsys.readouterr()
        assert main(["sample", str(alone), "--prompt", "The river", "--max-new-tokens", "30", "--seed", str(seed)]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0] != texts[2]
    assert texts[0].startswith("The river") and len(texts[0]) > len("The river\n")
    # The exported weights are the final checkpoint's parameters under MiniGPT's own keys.
    from safetensors.torch import load_file

    from minitrain.checkpoint import consolidated_state_dict

    exported = load_file(str(alone / "model.safetensors"))
    saved = consolidated_state_dict(str(root / "run"))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)


def test_greedy_sampling_is_the_models_argmax(trained):
    from minitrain.apps.sample import generate, load_exported

    root, _ = trained
    model, _ = load_exported(str(root / "model"))
    ids = generate(model, [5, 6, 7], max_new_tokens=4, temperature=0.0, top_k=0, seed=0)
    for i in range(3, 7):
        with torch.no_grad():
            assert ids[i] == int(model(torch.tensor([ids[:i]]))[0, -1].argmax())


def test_report_plots_the_run(trained, capsys):
    root, _ = trained
    assert main(["report", str(root / "run")]) == 0
    out = capsys.readouterr().out
    assert "best val loss" in out and "where a step went" in out
    assert {"loss.png", "report.png", "summary.txt"} <= {p.name for p in (root / "run" / "report").iterdir()}


def _one_line_error(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err, err


def test_bad_input_to_export_and_sample_exits_2_with_one_line(trained, tmp_path, capsys):
    root, _ = trained
    _one_line_error(capsys, ["export", str(tmp_path / "nope"), str(tmp_path / "out")], "does not exist")
    (tmp_path / "empty-run" / "checkpoints").mkdir(parents=True)
    _one_line_error(capsys, ["export", str(tmp_path / "empty-run"), str(tmp_path / "out")], "has no checkpoint yet")
    _one_line_error(capsys, ["export", str(root / "run"), str(root / "model")], "already exists and is not empty")
    _one_line_error(capsys, ["export", str(root / "run"), str(tmp_path / "no" / "such" / "out")], "does not exist")
    assert not (tmp_path / "out").exists()
    _one_line_error(capsys, ["sample", str(tmp_path)], "is not a model directory")
    for flag, value, match in (("--max-new-tokens", "0", "at least 1"), ("--temperature", "-1", ">= 0"),
                               ("--top-k", "-2", ">= 0")):
        _one_line_error(capsys, ["sample", str(root / "model"), "--prompt", "a", flag, value], match)
    broken = tmp_path / "broken"
    shutil.copytree(root / "model", broken)
    (broken / "config.json").write_text("{not json")
    _one_line_error(capsys, ["sample", str(broken)], "cannot read the model")


def test_a_text_file_given_as_the_corpus_points_at_data_prepare(tmp_path, capsys):
    _one_line_error(capsys, ["train", "--corpus", str(NOTES), "--out", str(tmp_path / "r")],
                    "is text, not token ids: tokenize it first with `minitrain data prepare")
    assert not (tmp_path / "r").exists()


@pytest.mark.multirank  # `train` launches its rank through the launcher
def test_a_synthetic_run_exports_and_samples_token_ids(tmp_path, capsys):
    """No tokenizer: the prompt and the output are ids. In one process, through the same commands."""
    assert main(["train", "--steps", "3", "--train.log_every", "0", "--out", str(tmp_path / "run")]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "model")]) == 0
    assert not (tmp_path / "model" / "tokenizer.json").exists()
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "model"), "--prompt", "1 2 3", "--max-new-tokens", "5"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids[:3] == ["1", "2", "3"] and len(ids) == 8 and all(0 <= int(i) < 64 for i in ids)
    _one_line_error(capsys, ["sample", str(tmp_path / "model"), "--prompt", "hello"], "token ids separated by spaces")
    _one_line_error(capsys, ["sample", str(tmp_path / "model"), "--prompt", "999"], "outside the model's vocabulary")
    assert main(["train", "--steps", "2", "--no-final-save", "--train.log_every", "0", "--out",
                 str(tmp_path / "unsaved")]) == 0
    assert not (tmp_path / "unsaved" / "checkpoints").exists()


# --- validation under ZeRO-2 and ZeRO-3 (the dp x tp x pp layouts: tests/parallel/test_composition.py) ---------------
EVAL = {"train.dtype": "float64", "train.steps": 2, "train.log_every": 0, "eval.every": 2, "eval.batches": 3,
        "train.batch_size": 2, "data.synthetic_tokens": 8192}


def _evaluate_at_init(topo):
    """Each ZeRO stage's held-out loss before any step (the weights every rank starts from)."""
    return {zero: Trainer(run_config(cli_values={**EVAL, "train.zero": zero, "dist.nproc": 2}),
                          topo).evaluate() for zero in (0, 2, 3)}


def test_zero_2_and_3_evaluate_like_one_plain_process():
    cfg = run_config(cli_values={**EVAL, "dist.nproc": 2})
    seed_everything(cfg.train.seed, 0)
    model = MiniGPT(cfg.model).to(torch.float64)  # what Trainer initialises, in one plain process
    val = torch.from_numpy(np.asarray(load_val(cfg), dtype=np.int64))
    seq = cfg.model.seq_len
    examples = torch.arange(3 * 4)  # 3 batches of 2 examples x 2 ranks, in order
    window = val[examples[:, None] * seq + torch.arange(seq + 1)]
    with torch.no_grad():
        logits = model(window[:, :-1])
        expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1)).item()
    for rank, got in enumerate(run_ranks(_evaluate_at_init, 2)):
        for zero, loss in got.items():
            assert abs(loss - expected) <= 1e-12, (rank, zero, loss, expected)
    single = Trainer(run_config(cli_values={**EVAL, "train.batch_size": 4}), Topology.single())
    assert abs(single.evaluate() - expected) <= 1e-12


def test_hashing_a_large_file_shows_a_progress_bar_on_a_terminal_only(tmp_path, monkeypatch):
    import hashlib
    import io
    import sys

    from minitrain.utils import progress
    from minitrain.checkpoint.files import sha256_of

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    big = tmp_path / "rank-00000.safetensors"
    big.write_bytes(b"x" * (3 << 20))
    monkeypatch.setattr(progress, "LARGE_BYTES", 2 << 20)  # 3 MiB counts as large here
    for stderr, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stderr)
        assert sha256_of(big) == hashlib.sha256(big.read_bytes()).hexdigest()
        assert ("sha256 rank-00000.safetensors" in stderr.getvalue()) == shown
    monkeypatch.setattr(progress, "LARGE_BYTES", 4 << 20)
    monkeypatch.setattr(sys, "stderr", Terminal())
    sha256_of(big)
    assert sys.stderr.getvalue() == ""  # a small file: no bar even on a terminal


def _corpus_copy(trained, tmp_path, name: str) -> Path:
    root, _ = trained
    copy = tmp_path / name
    shutil.copytree(root / "notes", copy)
    return copy


def test_a_damaged_corpus_directory_is_refused_before_anything_is_written(trained, tmp_path, capsys):
    unfinished = _corpus_copy(trained, tmp_path, "unfinished")
    (unfinished / "index.json").unlink()  # what a prepare cut short leaves
    _one_line_error(capsys, ["train", "--corpus", str(unfinished), "--out", str(tmp_path / "r2")],
                    "holds no index.json")
    missing = _corpus_copy(trained, tmp_path, "missing")
    (missing / "train-00000.bin").unlink()
    _one_line_error(capsys, ["train", "--corpus", str(missing), "--out", str(tmp_path / "r3")], "is missing")
    _one_line_error(capsys, ["train", "--corpus", str(missing / "val-00000.bin"), "--out", str(tmp_path / "r4")],
                    f"pass --corpus {missing}")  # its dtype is in index.json: never read a shard as a bare .bin
    assert not any((tmp_path / f"r{i}").exists() for i in range(2, 5))


def test_a_shard_with_ids_past_the_index_vocabulary_stops_the_run_at_its_first_batch(trained, tmp_path, capsys):
    small = _corpus_copy(trained, tmp_path, "small-vocab")
    index = json.loads((small / "index.json").read_text())
    (small / "index.json").write_text(json.dumps({**index, "vocab_size": 300}) + "\n")  # uint16 still; ids to 511
    _one_line_error(capsys, ["train", "--corpus", str(small), "--out", str(tmp_path / "r1"), "--steps", "4",
                             "--ckpt.every_steps", "1"], "beyond the vocabulary of 300 that index.json states")
    assert not list((tmp_path / "r1").glob("checkpoints/step-*"))  # nothing saved after it


def test_a_resumed_run_remembers_its_best_validation_loss(tmp_path):
    common = ["--nproc", "1", "--eval-every", "2", "--eval-batches", "2", "--train.log_every", "0",
              "--out", str(tmp_path / "run")]
    first = run_cli("train", "--steps", "4", "--ckpt-every-steps", "2", *common)
    assert first.returncode == 0, first.stderr
    # Continued with a learning rate that wrecks the model: the best stays the first session's.
    second = run_cli("train", "--steps", "6", "--resume", "auto", "--lr", "30", "--train.grad_clip", "0",
                     "--spike-factor", "0", *common)
    assert second.returncode == 0, second.stderr
    steps = _steps(tmp_path / "run")
    best = min((s for s in steps if s["val_loss"] is not None), key=lambda s: s["val_loss"])
    assert best["step"] <= 4 and f"best val loss {best['val_loss']:.4f}" in second.stdout, second.stdout


def test_sample_refuses_a_prompt_that_is_not_text_and_a_config_that_builds_no_model(trained, tmp_path, capsys):
    root, _ = trained
    _one_line_error(capsys, ["sample", str(root / "model"), "--prompt", "caf\udcff"], "not valid UTF-8")
    _one_line_error(capsys, ["sample", str(root / "model"), "--temperature", "inf"], "finite number")
    bad = tmp_path / "bad-heads"
    shutil.copytree(root / "model", bad)
    config = json.loads((bad / "config.json").read_text())
    config["model"]["n_head"] = 5  # does not divide d_model 64
    (bad / "config.json").write_text(json.dumps(config))
    _one_line_error(capsys, ["sample", str(bad)], "does not divide model.d_model=64")


def test_a_slow_rank_is_named_in_the_summary_and_its_busy_time_is_in_the_metrics(tmp_path):
    """A straggler: rank 1 sleeps 0.15 s before every step; rank 0 then waits for it in the gradient sync,
    which is not busy time, so rank 1's busy time per step is many times rank 0's."""
    run = run_cli("train", "--nproc", "2", "--steps", "8", "--train.log_every", "0", "--no-final-save",
                  "--fault.kind", "slow", "--fault.rank", "1", "--fault.step", "1", "--fault.slow_s", "0.15",
                  "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr
    assert "straggler: rank 1," in run.stdout, run.stdout
    busy = [s["busy_s_per_rank"] for s in _steps(tmp_path / "run")]
    assert all(len(b) == 2 and b[1] > 0.15 and b[0] < 0.15 for b in busy[1:]), busy


def test_the_straggler_report_compares_each_rank_with_the_others():
    from minitrain.train.metrics import straggler_report

    steps = [[0.010, 0.011, 0.010, 0.030]] * 6
    report = straggler_report(steps, warmup=1, factor=1.5)
    assert report["slowest"] == 3 and report["straggler"] == 3 and report["ratio"] == pytest.approx(3.0)
    assert straggler_report(steps, warmup=1, factor=0)["straggler"] is None  # off
    assert straggler_report([[0.01, 0.012]] * 3, warmup=0, factor=1.5)["straggler"] is None  # 1.2x: not one
    assert straggler_report([[0.01]] * 3, warmup=0, factor=1.5) is None  # one rank: nothing to compare
