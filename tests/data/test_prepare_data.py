"""`minitrain data prepare`: the sharded corpus it writes from text, .jsonl and .parquet files, directories and
globs, its help, and its refusals (resumes, workers and stores: test_prepare_resume.py)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from minitrain.apps.cli import main
from minitrain.corpus.tokenizer import EOT, byte_level_tokenizer, encode, encode_batch
from tests.helpers.prepared_corpus import (
    CORPUS,
    TRICKY,
    documents_of,
    notes_bpe,
    paragraphs,
    prepare,
    read_corpus,
    same_files,
    stream_of,
    write_jsonl,
)


def test_prepare_the_shipped_corpus(tmp_path, capsys):
    out = tmp_path / "data" / "notes"  # parent directories are made
    code, stdout, err = prepare(capsys, CORPUS, "--vocab-size", 512, "--out", out)
    assert code == 0 and err == ""  # no progress bar off a terminal
    assert stdout.count("\n") == 1 and stdout.startswith(f"wrote {out}: ") and "vocab 512, uint16" in stdout
    assert "in 2 shards from 1 document" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "tokenizer.json", "train-00000.bin", "val-00000.bin"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["notes"]  # nothing left beside it

    index, _ = read_corpus(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = CORPUS.read_text(encoding="utf-8")
    expected = [*encode(tok, text), tok.token_to_id(EOT)]
    n_val = round(0.1 * len(expected))
    assert index.meta == {"format": "minitrain-shards/1", "vocab_size": 512, "dtype": "uint16",
                          "eot_id": tok.token_to_id(EOT), "tokenizer": "tokenizer.json", "val_fraction": 0.1,
                          "shard_bytes": 256 * 2**20, "documents": 1,
                          "sources": [{"path": str(CORPUS), "bytes": CORPUS.stat().st_size, "documents": 1}]}
    assert [(s.split, s.tokens) for s in index.shards] == [("train", len(expected) - n_val), ("val", n_val)]
    assert encode(tok, text) == encode(notes_bpe(), text)  # the file holds the tokenizer that was trained

    stream = stream_of(out)
    assert stream.dtype == np.uint16 and stream.tolist() == expected
    assert documents_of(tok, stream, index.meta["eot_id"]) == [text]

    # The saved tokenizer, given back with --tokenizer, makes the same files.
    again = tmp_path / "again"
    assert prepare(capsys, CORPUS, "--tokenizer", out / "tokenizer.json", "--out", again)[0] == 0
    same_files(out, again)


def test_prepare_jsonl_and_text_files(tmp_path, capsys):
    docs = ["first post: héllo", "", "  second\n\tpost 🎉 ", f"third, with {EOT} as text"]
    lines = [json.dumps({"body": d, "id": i}, ensure_ascii=i % 2 == 0) for i, d in enumerate(docs)]
    (tmp_path / "posts.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n", encoding="utf-8")
    (tmp_path / "page.md").write_text("# a page\r\nwith CRLF\r\n", encoding="utf-8", newline="")
    out = tmp_path / "out"
    out.mkdir()  # an empty --out is fine
    code, stdout, _ = prepare(capsys, tmp_path / "posts.jsonl", tmp_path / "page.md", "--vocab-size", 300,
                              "--text-field", "body", "--val-fraction", 0.5, "--out", out)
    assert code == 0 and "from 5 documents" in stdout
    index, splits = read_corpus(out)
    assert index.meta["documents"] == 5 and [s["documents"] for s in index.meta["sources"]] == [4, 1]
    assert index.meta["sources"][1] == {"path": str(tmp_path / "page.md"), "bytes": 21, "documents": 1}
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    stream = stream_of(out)
    assert documents_of(tok, stream, index.meta["eot_id"]) == [*docs, "# a page\r\nwith CRLF\r\n"]
    assert len(splits["val"][0]) == round(0.5 * len(stream))


def test_prepare_with_the_byte_level_tokenizer(tmp_path, capsys):
    byte_level_tokenizer().save(str(tmp_path / "bytes.json"))
    text = "bytes: ünïcödé 漢字\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    assert prepare(capsys, tmp_path / "a.txt", "--tokenizer", tmp_path / "bytes.json", "--out", tmp_path / "o")[0] == 0
    index, _ = read_corpus(tmp_path / "o")
    assert index.vocab_size == 256 and index.meta["eot_id"] is None  # no EOT to end documents with
    assert stream_of(tmp_path / "o").tolist() == list(text.encode("utf-8"))


def test_prepare_stores_ids_above_65535_as_uint32(tmp_path, capsys):
    tok = byte_level_tokenizer()
    tok.add_tokens([f"<w{i}>" for i in range(256, 70000)])  # ordinary added tokens: matched in text
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("x<w69999>y<w300>z", encoding="utf-8")
    code, _, err = prepare(capsys, tmp_path / "a.txt", "--tokenizer", tmp_path / "big.json", "--val-fraction", 0.5,
                           "--out", tmp_path / "o")
    assert code == 0, err
    index, _ = read_corpus(tmp_path / "o")
    assert index.meta["dtype"] == "uint32" and index.vocab_size == 70000
    stream = stream_of(tmp_path / "o")
    assert stream.dtype == np.uint32 and stream.tolist() == [120, 69999, 121, 300, 122]


def test_shards_hold_at_most_shard_mb_and_split_each_block(tmp_path, capsys, notes_tokenizer):
    docs = paragraphs(seed=1, count=60)
    write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out"
    code, stdout, _ = prepare(capsys, tmp_path / "docs.jsonl", "--tokenizer", notes_tokenizer, "--shard-mb", 0.002,
                              "--val-fraction", 0.25, "--out", out)
    assert code == 0
    index, splits = read_corpus(out)  # every shard at most shard_bytes
    assert index.meta["shard_bytes"] == int(0.002 * 2**20) == 2097
    block = 2097 // 2
    assert len(splits["train"]) > 3 and all(len(t) == block - round(0.25 * block) for t in splits["train"][:-1])
    assert all(len(v) == round(0.25 * block) for v in splits["val"][:-1])
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert documents_of(tok, stream_of(out), index.meta["eot_id"]) == docs  # the stream in order, whole
    assert f"in {len(index.shards)} shards from 60 documents" in stdout


def test_parquet_input(tmp_path, capsys, notes_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [*paragraphs(seed=3, count=20), "", "ünïcödé 🎉"]
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), tmp_path / "docs.parquet", row_group_size=7)
    write_jsonl(tmp_path / "same.jsonl", docs, "body")
    for name in ("docs.parquet", "same.jsonl"):
        code, stdout, err = prepare(capsys, tmp_path / name, "--tokenizer", notes_tokenizer, "--text-field", "body",
                                    "--out", tmp_path / name.split(".")[0])
        assert code == 0 and f"from {len(docs)} documents" in stdout, err
    index, _ = read_corpus(tmp_path / "docs")
    assert index.meta["sources"] == [{"path": str(tmp_path / "docs.parquet"),
                                      "bytes": (tmp_path / "docs.parquet").stat().st_size, "documents": len(docs)}]
    for split in ("train", "val"):  # the same documents, the same tokens
        same = read_corpus(tmp_path / "same")[0]
        assert [s.sha256 for s in index.split(split)] == [s.sha256 for s in same.split(split)]


@pytest.mark.parametrize("case", ["missing column", "int column", "null", "not parquet", "no pyarrow"])
def test_parquet_refusals(tmp_path, capsys, notes_tokenizer, monkeypatch, case):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    columns = {"missing column": {"body": ["a"]}, "int column": {"text": [1, 2]}, "null": {"text": ["ok", None]},
               "not parquet": None, "no pyarrow": {"text": ["a b c d e f"]}}[case]
    if columns is None:
        path.write_text("text, not parquet")
    else:
        pq.write_table(pa.table(columns), path)
    if case == "no pyarrow":
        monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if it were not installed
    code, stdout, err = prepare(capsys, path, "--tokenizer", notes_tokenizer, "--out", tmp_path / "o")
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert {"missing column": f'{path}: no column "text" (it has body); name the column',
            "int column": f'{path}: column "text" is int64, not a string column',
            "null": f'{path}: row 2: "text" is null, not a string',
            "not parquet": f"cannot read {path} as parquet",
            "no pyarrow": "pip install 'minitrain[data]'"}[case] in err
    assert not (tmp_path / "o").exists()


def test_directory_and_glob_inputs(tmp_path, capsys, notes_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tree = tmp_path / "tree"
    (tree / "b" / "deeper").mkdir(parents=True)
    (tree / ".hidden").mkdir()
    (tree / "b" / "deeper" / "z.txt").write_text("deep text")
    (tree / "b" / "a.md").write_text("markdown text")
    write_jsonl(tree / "c.jsonl", ["line one", "line two"])
    pq.write_table(pa.table({"text": ["a row", "another row"]}), tree / "a.parquet")
    (tree / "notes.csv").write_text("not,taken")  # an unknown suffix: not walked
    (tree / ".hidden" / "x.txt").write_text("hidden")
    (tree / ".dot.txt").write_text("hidden")
    out = tmp_path / "dir"
    assert prepare(capsys, tree, "--tokenizer", notes_tokenizer, "--val-fraction", 0.5, "--out", out)[0] == 0
    index, _ = read_corpus(out)
    found = [str(tree / "a.parquet"), str(tree / "b" / "a.md"), str(tree / "b" / "deeper" / "z.txt"),
             str(tree / "c.jsonl")]
    assert [s["path"] for s in index.meta["sources"]] == found  # walked in name order
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert documents_of(tok, stream_of(out), index.meta["eot_id"]) == [
        "a row", "another row", "markdown text", "deep text", "line one", "line two"]

    # A glob is expanded by prepare, in name order, whatever the shell would have done; a directory matched is walked.
    code, _, err = prepare(capsys, str(tree / "**" / "*.txt"), str(tree / "c.*"), "--tokenizer", notes_tokenizer,
                                "--val-fraction", 0.5, "--out", tmp_path / "glob")
    assert code == 0, err
    assert [s["path"] for s in read_corpus(tmp_path / "glob")[0].meta["sources"]] == [
        str(tree / "b" / "deeper" / "z.txt"), str(tree / "c.jsonl")]
    code, _, err = prepare(capsys, tree, str(tree / "c.*"), "--tokenizer", notes_tokenizer, "--out", tmp_path / "twice")
    assert code == 2 and f"{tree / 'c.jsonl'} (from {tree} and {tree / 'c.*'}) is given twice" in err


def test_encode_texts_gives_the_ids_of_encode_batch(tmp_path):
    from minitrain.corpus import encode_pool

    notes_bpe().save(str(tmp_path / "tok.json"))
    tok = encode_pool.load(str(tmp_path / "tok.json"))
    texts = [*TRICKY, "x" * 1000 + " then words", *paragraphs(seed=5, count=5)]  # long runs are cut in pieces
    flat, lengths = encode_pool.encode_texts(tok, texts, 7, np.dtype("<u2"))
    expected = [[*ids, 7] for ids in encode_batch(notes_bpe(), texts)]
    assert lengths.tolist() == [len(ids) for ids in expected] and flat.dtype == np.dtype("<u2")
    assert flat.tolist() == [i for ids in expected for i in ids]
    flat, lengths = encode_pool.encode_texts(tok, ["", "ab"], None, np.dtype("<u4"))
    assert lengths.tolist() == [0, 2] and flat.dtype == np.dtype("<u4")


def test_data_prepare_help_teaches(capsys):
    with pytest.raises(SystemExit) as e:
        main(["data", "prepare", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for needle in ("train-00000.bin", "val-00000.bin", "index.json", "tokenizer.json", "prepare.json", "--val-fraction",
                   "--shard-mb", "--workers", "--resume", ".parquet", "s3://bucket",
                   "minitrain data prepare src/minitrain/corpora/field_notes.txt --vocab-size 512 --out data/notes",
                   "minitrain train --corpus data/notes", "pip install 'minitrain[data]'"):
        assert needle in text


def test_hdfs_without_libhdfs_is_one_line(tmp_path, capsys, notes_tokenizer):
    code, _, err = prepare(capsys, _ok(tmp_path), "--tokenizer", notes_tokenizer, "--out", "hdfs://namenode:8020/c")
    assert code == 2 and err.count("\n") == 1
    assert "cannot use --out hdfs://namenode:8020/c: pyarrow's HadoopFileSystem is not available here" in err


# ---- refusals: exit 2, one line, nothing written ---------------------------------------------------------


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def _ok(tmp_path):
    return _write(tmp_path, "ok.txt", "some text " * 50)


def _jsonl(tmp_path, second_line):
    return _write(tmp_path, "docs.jsonl", '{"text": "fine"}\n' + second_line + "\n")


def _empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.csv").write_text("a,b")  # not a known suffix
    return tmp_path / "empty"


REFUSALS = {  # name: (inputs and flags, given tmp_path; what the message says)
    "missing input": (lambda p: ["nope.txt", "--vocab-size", 300], "input nope.txt does not exist"),
    "empty directory": (lambda p: [_empty_dir(p), "--vocab-size", 300],
                        "empty is a directory holding no .txt, .md, .text, .rst, .jsonl, .parquet file"),
    "glob matching nothing": (lambda p: [p / "*.jsonl", "--vocab-size", 300], "*.jsonl matches no file"),
    "not UTF-8": (lambda p: [_write(p, "bad.txt", b"caf\xe9 latin-1"), "--vocab-size", 300], "bad.txt is not UTF-8"),
    "empty text": (lambda p: [_ok(p), _write(p, "empty.txt", ""), "--vocab-size", 300], "empty.txt holds no text"),
    "blank jsonl": (lambda p: [_write(p, "e.jsonl", "\n\n"), "--vocab-size", 300], "e.jsonl holds no text"),
    "empty fields": (lambda p: [_write(p, "e.jsonl", '{"text": ""}\n'), "--vocab-size", 300], "e.jsonl holds no text"),
    "not JSON": (lambda p: [_jsonl(p, "{oops"), "--vocab-size", 300], "docs.jsonl:2: not JSON"),
    "no field": (lambda p: [_jsonl(p, '{"body": "x"}'), "--vocab-size", 300], 'docs.jsonl:2: no "text" field'),
    "not an object": (lambda p: [_jsonl(p, '["text"]'), "--vocab-size", 300], 'docs.jsonl:2: no "text" field'),
    "not a string": (lambda p: [_jsonl(p, '{"text": 3}'), "--vocab-size", 300], 'docs.jsonl:2: "text" is a number'),
    "null field": (lambda p: [_jsonl(p, '{"text": null}'), "--vocab-size", 300], '"text" is null, not a string'),
    "jsonl not UTF-8": (lambda p: [_write(p, "d.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n'), "--vocab-size", 300],
                        "d.jsonl:2: not UTF-8"),
    "vocab too small": (lambda p: [_ok(p), "--vocab-size", 256], "--vocab-size must be between 257"),
    "vocab too large": (lambda p: [_ok(p), "--vocab-size", 2**32 + 1], "and 4294967296, got 4294967297"),
    "val fraction 0": (lambda p: [_ok(p), "--vocab-size", 300, "--val-fraction", 0], "--val-fraction must lie in"),
    "val fraction > 0.5": (lambda p: [_ok(p), "--vocab-size", 300, "--val-fraction", 0.6], "(0, 0.5], got 0.6"),
    "val fraction nan": (lambda p: [_ok(p), "--vocab-size", 300, "--val-fraction", "nan"], "got nan"),
    "shard too small": (lambda p: [_ok(p), "--vocab-size", 300, "--shard-mb", 0.0005],
                        "--shard-mb must be at least 0.000976562 (1024 bytes), got 0.0005"),
    "shard nan": (lambda p: [_ok(p), "--vocab-size", 300, "--shard-mb", "nan"], "--shard-mb must be at least"),
    "no workers": (lambda p: [_ok(p), "--vocab-size", 300, "--workers", 0], "--workers must be at least 1, got 0"),
    "too few val tokens": (lambda p: [_write(p, "tiny.txt", "ab"), "--vocab-size", 257],
                           "3 tokens: 3 for train and 0 for val, and each needs at least 2; give more text or a larger"),
    "too few train tokens": (lambda p: [_write(p, "tiny.txt", "ab"), "--vocab-size", 257, "--val-fraction", 0.5],
                             "1 for train and 2 for val"),
    "tokenizer missing": (lambda p: [_ok(p), "--tokenizer", p / "none.json"], "none.json does not exist"),
    "tokenizer invalid": (lambda p: [_ok(p), "--tokenizer", _write(p, "t.json", "{not json")], "cannot load tokenizer"),
    "both": (lambda p: [_ok(p), "--vocab-size", 300, "--tokenizer", p / "t.json"], "not both"),
    "neither": (lambda p: [_ok(p)], "give either --vocab-size N"),
    "same input twice": (lambda p: [_ok(p), p / "ok.txt", "--vocab-size", 300], "ok.txt is given twice"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, case):
    make_args, message = REFUSALS[case]
    args = make_args(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "made" / "out"  # a parent to make, too: it must not be left behind
    code, stdout, err = prepare(capsys, *args, "--out", out)
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("minitrain data: error: ")
    assert message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no --out, parent or temporary file


@pytest.mark.parametrize("workers", [1, 2])
def test_a_tokenizer_that_cannot_encode_removes_what_it_wrote(tmp_path, capsys, workers):
    from tokenizers import models

    tok = Tokenizer(models.WordLevel({"known": 0}))  # no [UNK]: any other word fails to encode
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "words.json"))
    code, _, err = prepare(capsys, _write(tmp_path, "a.txt", "known unknown"), "--tokenizer", tmp_path / "words.json",
                           "--workers", workers, "--out", tmp_path / "o")
    assert code == 2 and err.count("\n") == 1 and "the tokenizer cannot encode the input" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("occupied", ["non-empty directory", "file"])
def test_refuses_an_occupied_out(tmp_path, capsys, occupied):
    out = tmp_path / "out"
    if occupied == "file":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    code, _, err = prepare(capsys, _ok(tmp_path), "--vocab-size", 300, "--out", out)
    assert code == 2 and err.count("\n") == 1
    assert ("choose another --out or delete it" if occupied != "file" else "is a file; choose another --out") in err
    assert (out.read_text() if occupied == "file" else (out / "keep.txt").read_text()) == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.txt", "out"]


def test_a_write_failure_is_one_line_and_leaves_nothing(tmp_path, capsys):
    blocker = _write(tmp_path, "blocker", "a file where --out's parent should be")
    code, _, err = prepare(capsys, _ok(tmp_path), "--vocab-size", 300, "--out", blocker / "out")
    assert code == 2 and err.count("\n") == 1 and err.startswith("minitrain data: error: cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "ok.txt"]
