"""`minitrain data prepare` cut short and resumed (by Ctrl-C at chosen blocks, by SIGKILL from outside), with
several workers, and into an S3 store: every way gives the bytes of one uninterrupted prepare."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minitrain.corpus.shard_index import INDEX, parse_index, sha256_of
from minitrain.corpus.shard_writer import JOURNAL, ShardWriter
from minitrain.corpus.tokenizer import byte_level_tokenizer
from tests.helpers.prepared_corpus import (
    corpus_args,
    paragraphs,
    prepare,
    read_corpus,
    same_files,
    write_jsonl,
)
from tests.helpers.s3_server import s3_server


def test_workers_give_the_same_bytes(tmp_path, capsys, notes_tokenizer):
    write_jsonl(tmp_path / "docs.jsonl", paragraphs(seed=2, count=1500))  # several batches of BATCH_DOCS
    for workers in (1, 2):
        code, _, err = prepare(capsys, tmp_path / "docs.jsonl", "--tokenizer", notes_tokenizer, "--shard-mb", 0.05,
                               "--workers", workers, "--out", tmp_path / f"w{workers}")
        assert code == 0, err
    same_files(tmp_path / "w1", tmp_path / "w2")
    assert len(read_corpus(tmp_path / "w2")[0].shards) > 4


@pytest.mark.parametrize("stop_after", [0, 1, 3, 7])
def test_resume_after_an_interruption_writes_what_an_uninterrupted_prepare_writes(
        tmp_path, capsys, notes_tokenizer, monkeypatch, stop_after):
    args = corpus_args(tmp_path, notes_tokenizer)
    assert prepare(capsys, *args, "--out", tmp_path / "whole")[0] == 0

    original, blocks = ShardWriter.end_block, []

    def end_block(self):
        if len(blocks) == stop_after:
            raise KeyboardInterrupt  # as Ctrl-C would, at a block's end (before its journal)
        blocks.append(self.block)
        return original(self)

    monkeypatch.setattr(ShardWriter, "end_block", end_block)
    code, _, err = prepare(capsys, *args, "--out", tmp_path / "cut")
    assert code == 130 and "add --resume to the same command" in err
    journal = json.loads((tmp_path / "cut" / JOURNAL).read_text())
    assert journal["blocks"] == stop_after and not (tmp_path / "cut" / INDEX).exists()
    monkeypatch.undo()
    code, _, err = prepare(capsys, *args, "--out", tmp_path / "cut")
    assert code == 2 and "holds an unfinished prepare (prepare.json); add --resume" in err
    code, _, err = prepare(capsys, *args, "--out", tmp_path / "cut", "--resume")
    assert code == 0, err
    same_files(tmp_path / "whole", tmp_path / "cut")


def _children(pid: int) -> list[int]:
    """The processes `pid` started (Linux's /proc; none where it is missing)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.parametrize("victim", ["prepare", "a worker"])
def test_a_killed_prepare_resumes_to_the_same_bytes(tmp_path, capsys, notes_tokenizer, victim):
    args = [str(a) for a in corpus_args(tmp_path, notes_tokenizer, count=10000, shard_mb=0.02)]
    assert prepare(capsys, *args, "--workers", 2, "--out", tmp_path / "whole")[0] == 0
    cut, journal = tmp_path / "cut", tmp_path / "cut" / JOURNAL
    process = subprocess.Popen([sys.executable, "-m", "minitrain", "data", "prepare", *args, "--workers", "2",
                                "--out", str(cut)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:  # until the journal lists a shard
            try:
                if json.loads(journal.read_text())["shards"]:
                    break
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.005)
        assert process.poll() is None, "the prepare ended before it could be killed: give it more input"
        children = _children(process.pid)
        if victim == "prepare":
            os.kill(process.pid, signal.SIGKILL)
        else:
            worker = next(c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())
            os.kill(worker, signal.SIGKILL)
            _, err = process.communicate(timeout=60)
            assert process.returncode == 2 and err.count("\n") == 1, err
            assert "a tokenizing worker process died (killed, or out of memory); what is written is kept: add " \
                   "--resume" in err
    finally:
        process.kill()
        process.communicate()
    assert not (cut / INDEX).exists() and json.loads(journal.read_text())["shards"]
    deadline = time.monotonic() + 30
    while any(map(_alive, children)) and time.monotonic() < deadline:  # orphaned, they leave on their own
        time.sleep(0.05)
    assert not any(map(_alive, children))
    # --workers shapes no byte of the output: a resume may change it.
    code, _, err = prepare(capsys, *args, "--out", cut, "--resume", "--workers", 1)
    assert code == 0, err
    same_files(tmp_path / "whole", cut)


def test_resume_refusals(tmp_path, capsys, notes_tokenizer, monkeypatch):
    args = corpus_args(tmp_path, notes_tokenizer)
    out = tmp_path / "out"
    code, _, err = prepare(capsys, *args, "--out", out, "--resume")
    assert code == 2 and "--resume: --out" in err and "holds no unfinished prepare (no prepare.json)" in err
    monkeypatch.setattr(ShardWriter, "end_block", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    assert prepare(capsys, *args, "--out", out)[0] == 130
    monkeypatch.undo()
    other_tok = tmp_path / "other.json"
    byte_level_tokenizer().save(str(other_tok))
    changes = {"--val-fraction": (["--val-fraction", 0.3], "--val-fraction is 0.3, was 0.2"),
               "--shard-mb": (["--shard-mb", 0.02], "--shard-mb (in bytes) is 20971, was 10485"),
               "--text-field": (["--text-field", "body"], "--text-field is 'body', was 'text'"),
               "--tokenizer": (["--tokenizer", other_tok], "--tokenizer (its sha256) is"),
               "--vocab-size": (["--vocab-size", 300, "--tokenizer", None], "--vocab-size is 300, was None")}
    for flag, (change, message) in changes.items():
        argv = list(args)
        for k in range(0, len(change), 2):
            if change[k] in argv:
                at = argv.index(change[k])
                del argv[at:at + 2]
            if change[k + 1] is not None:
                argv += change[k:k + 2]
        code, _, err = prepare(capsys, *argv, "--out", out, "--resume")
        assert code == 2 and err.count("\n") == 1, flag
        assert "--resume with other arguments than the unfinished prepare" in err and message in err, (flag, err)
    with open(args[0], "a") as f:  # an input that grew since
        f.write(json.dumps({"text": "one more"}) + "\n")
    code, _, err = prepare(capsys, *args, "--out", out, "--resume")
    assert code == 2 and f"input {args[0]} (" in err and "--resume with other arguments" in err
    assert (out / JOURNAL).exists()  # a refused resume leaves the prepare as it was


def test_resume_of_a_finished_corpus_is_refused(tmp_path, capsys, notes_tokenizer):
    args = corpus_args(tmp_path, notes_tokenizer, count=20)
    assert prepare(capsys, *args, "--out", tmp_path / "o")[0] == 0
    code, _, err = prepare(capsys, *args, "--out", tmp_path / "o", "--resume")
    assert code == 2 and "already holds a finished corpus (index.json); nothing to resume" in err


# ---- stores ----------------------------------------------------------------------------------------------


def test_s3_output_holds_the_same_shards(tmp_path, capsys, notes_tokenizer):
    args = corpus_args(tmp_path, notes_tokenizer, count=100)
    assert prepare(capsys, *args, "--out", tmp_path / "local")[0] == 0
    with s3_server("prepared") as fs:
        capsys.readouterr()  # the server's greeting
        code, stdout, err = prepare(capsys, *args, "--workers", 2, "--out", "s3://prepared/corpus/v1")
        assert code == 0, err
        assert stdout.startswith("wrote s3://prepared/corpus/v1: ")
        assert "tokenizer s3://prepared/corpus/v1/tokenizer.json" in stdout
        stored = {path.rsplit("/", 1)[-1]: fs.cat_file(path) for path in fs.ls("prepared/corpus/v1", detail=False)}
        local = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
        assert set(stored) == set(local) and len(stored) > 4
        for name, data in local.items():
            if name != INDEX:
                assert stored[name] == data, name
        index = parse_index(stored[INDEX].decode(), "s3://prepared/corpus/v1")
        assert index.meta == parse_index(local[INDEX].decode(), "local").meta  # the same, sources and all
        assert all(sha256_of(stored[s.name]) == s.sha256 for s in index.shards)
        code, _, err = prepare(capsys, *args, "--out", "s3://prepared/corpus/v1")
        assert code == 2 and "already holds a finished corpus" in err
        code, _, err = prepare(capsys, *args, "--out", "s3://no-such-bucket/corpus")
        assert code == 2 and err.count("\n") == 1
        assert "writing tokenizer.json to s3://no-such-bucket/corpus failed: FileNotFoundError" in err


def test_a_resume_reuses_the_trained_tokenizer(tmp_path, capsys, monkeypatch):
    args = [*corpus_args(tmp_path, tmp_path / "unused.json", count=100)[:1], "--vocab-size", 400, "--shard-mb", 0.01]
    assert prepare(capsys, *args, "--out", tmp_path / "whole")[0] == 0
    monkeypatch.setattr(ShardWriter, "end_block", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    assert prepare(capsys, *args, "--out", tmp_path / "cut")[0] == 130
    monkeypatch.undo()
    from minitrain.corpus import tokenizer

    monkeypatch.setattr(tokenizer, "train_bpe", lambda *a, **k: pytest.fail("trained the BPE again"))
    code, _, err = prepare(capsys, *args, "--out", tmp_path / "cut", "--resume")
    assert code == 0, err
    same_files(tmp_path / "whole", tmp_path / "cut")
