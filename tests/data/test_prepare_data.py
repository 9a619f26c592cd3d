"""`minitrain data prepare`, the tokenizers behind it, the sharded corpus it writes (resumed, from many workers,
to a store), and the token-file format of earlier versions."""
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

import minitrain
from minitrain.apps.cli import main
from minitrain.corpus import token_files
from minitrain.corpus.shard_index import (
    INDEX,
    META_KEYS,
    ShardIndex,
    parse_index,
    sha256_of,
    shard_name,
)
from minitrain.corpus.shard_writer import JOURNAL, ShardWriter
from minitrain.corpus.tokenizer import (
    EOT,
    MIN_BPE_VOCAB,
    byte_level_tokenizer,
    byte_symbols,
    decode,
    encode,
    encode_batch,
    eot_id,
    load_tokenizer,
    train_bpe,
    vocab_size,
)
from minitrain.errors import ConfigError
from tests.helpers.s3_server import s3_server

CORPUS = Path(minitrain.__file__).parent / "corpora" / "field_notes.txt"

# Text that breaks a round trip when a tokenizer adds a prefix space, trims, normalizes or drops unknowns.
TRICKY = ["", " ", "  two leading", "trailing  ", "a  b   c", "\n\nnew\nlines\n", "\ttabs\t\t", "\r\n crlf \r\n",
          "héllo wörld", "漢字かな交じり文", "emoji 🎉👩‍👩‍👧 flag 🇳🇿", "nul\x00 del\x7f c1\x85", f"a literal {EOT} in text",
          "nbsp\u00a0line sep\u2028zero width\u200b", "Å (one code point) vs Å (two)", "ﬁ ligature, ① circled",
          "\ufeffbyte-order mark", "  \n \t "]


@functools.cache
def notes_bpe() -> Tokenizer:
    """The BPE the shipped corpus trains, at the size the CLI tests use (cached: hypothesis calls it often)."""
    return train_bpe([CORPUS.read_text(encoding="utf-8")], 512)


# ---- tokenizers ------------------------------------------------------------------------------------------


def test_byte_level_tokenizer_ids_are_the_utf8_bytes(tmp_path):
    tok = byte_level_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == 256 and eot_id(tok) is None
    assert sorted(tok.get_vocab().values()) == list(range(256))
    assert byte_symbols() == [symbol for symbol, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    assert set(byte_symbols()) == set(pre_tokenizers.ByteLevel.alphabet())
    tok.save(str(tmp_path / "tokenizer.json"))
    reloaded = load_tokenizer(tmp_path / "tokenizer.json")
    for text in [*TRICKY, CORPUS.read_text(encoding="utf-8")]:
        for t in (tok, reloaded):
            assert encode(t, text) == list(text.encode("utf-8"))
            assert decode(t, encode(t, text)) == text


def test_byte_level_tokenizer_maps_every_byte_that_utf8_uses():
    # UTF-8 uses 243 byte values: all but C0, C1 and F5..FF. U+0000..U+00FF bring ASCII and every continuation
    # byte; then one character for each lead byte of a 2-, 3- and 4-byte sequence.
    text = "".join([*map(chr, range(0x100)), *(chr((lead - 0xC0) << 6) for lead in range(0xC2, 0xE0)),
                    *(chr(max(0x800, (lead - 0xE0) << 12)) for lead in range(0xE0, 0xF0)),
                    *(chr(max(0x10000, (lead - 0xF0) << 18)) for lead in range(0xF0, 0xF5))])
    assert len(set(text.encode("utf-8"))) == 243
    assert encode(byte_level_tokenizer(), text) == list(text.encode("utf-8"))


def test_bpe_round_trips_exactly_and_compresses():
    tok = notes_bpe()
    assert vocab_size(tok) == 512 and eot_id(tok) == tok.token_to_id(EOT)
    text = CORPUS.read_text(encoding="utf-8")
    ids = encode(tok, text)
    assert decode(tok, ids) == text and len(ids) < len(text.encode("utf-8")) / 2
    for s in TRICKY:
        assert decode(tok, encode(tok, s)) == s, repr(s)
    assert encode_batch(tok, TRICKY) == [encode(tok, s) for s in TRICKY]
    assert decode(tok, np.array(ids, dtype=np.uint16)) == text  # ids straight from a token file


def test_text_never_encodes_to_the_end_of_text_id():
    tok = notes_bpe()
    assert eot_id(tok) not in encode(tok, f"one{EOT}two {EOT}")
    assert decode(tok, [*encode(tok, "one"), eot_id(tok), *encode(tok, "two")]) == f"one{EOT}two"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_round_trips(text):
    for tok in (notes_bpe(), byte_level_tokenizer()):
        assert decode(tok, encode(tok, text)) == text


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from("ab é漢🎉 \n\t"), max_size=40), min_size=1, max_size=5))
def test_a_bpe_trained_on_any_text_round_trips_it(texts):
    tok = train_bpe(texts, 300)
    assert 257 <= vocab_size(tok) <= 300
    for text in texts:
        assert decode(tok, encode(tok, text)) == text


def test_vocab_size_bounds():
    assert vocab_size(train_bpe(["aaaa"], 2**32)) == MIN_BPE_VOCAB + 2  # "aa" and "aaaa": all the text allows
    assert vocab_size(train_bpe(["abc abc"], MIN_BPE_VOCAB)) == MIN_BPE_VOCAB  # bytes and EOT, no merges
    for bad in (MIN_BPE_VOCAB - 1, 2**32 + 1):
        with pytest.raises(ConfigError, match="--vocab-size must be between 257"):
            train_bpe(["text"], bad)


def test_load_tokenizer_refuses_what_is_not_one(tmp_path):
    (tmp_path / "bad.json").write_text('{"version": "1.0"}')
    for path, why in ((tmp_path / "absent.json", "does not exist"), (tmp_path, "is a directory"),
                      (tmp_path / "bad.json", "cannot load tokenizer")):
        with pytest.raises(ConfigError, match=why) as e:
            load_tokenizer(path)
        assert "\n" not in str(e.value)


# ---- the token-file format -------------------------------------------------------------------------------


def test_dtype_for_and_write_split(tmp_path):
    assert token_files.dtype_for(2**16).name == "uint16" and token_files.dtype_for(2**16 + 1).name == "uint32"
    assert token_files.dtype_for(2**32).name == "uint32"
    with pytest.raises(ValueError):
        token_files.dtype_for(2**32 + 1)
    path = tmp_path / "t.bin"
    assert token_files.write_split(path, np.array([1, 65535]), np.uint16) == 2
    assert path.read_bytes() == b"\x01\x00\xff\xff"  # little-endian, no header
    with pytest.raises(ValueError, match="beyond"):
        token_files.write_split(path, np.array([65536]), np.uint16)


# ---- `minitrain data prepare` ----------------------------------------------------------------------------


def prepare(capsys, *argv) -> tuple[int, str, str]:
    code = main(["data", "prepare", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def notes_tokenizer(tmp_path_factory) -> Path:
    """notes_bpe() as a tokenizer.json: --tokenizer spares the tests a BPE training each."""
    path = tmp_path_factory.mktemp("tokenizer") / "notes.json"
    notes_bpe().save(str(path))
    return path


def read_corpus(out: Path) -> tuple[ShardIndex, dict[str, list[np.ndarray]]]:
    """index.json, checked as a reader checks it (every shard's size and sha256 too), and each split's shards."""
    index = parse_index((out / INDEX).read_text(), str(out))
    assert (out / INDEX).read_text() == index.to_json()  # written by ShardIndex, nothing else in it
    assert set(index.meta) | {"shards"} == set(META_KEYS)
    assert not (out / JOURNAL).exists()
    splits: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for shard in index.shards:
        data = (out / shard.name).read_bytes()
        assert sha256_of(data) == shard.sha256 and len(data) == shard.nbytes(index.dtype) <= index.meta["shard_bytes"]
        splits[shard.split].append(np.frombuffer(data, dtype=index.dtype))
    for split, shards in splits.items():  # shards of a split are numbered 0, 1, ... in the index's order
        assert [s.name for s in index.split(split)] == [shard_name(split, k) for k in range(len(shards))]
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([INDEX, "tokenizer.json", *(s.name for s in index.shards)])
    return index, splits


def stream_of(out: Path) -> np.ndarray:
    """The token stream back from the shards: block k is train shard k, then val shard k."""
    index, splits = read_corpus(out)
    blocks = index.meta["shard_bytes"] // index.dtype.itemsize
    stream, train, val = [], iter(splits["train"]), iter(splits["val"])
    for k in range(max(len(splits["train"]), len(splits["val"]))):
        names = {s.name for s in index.shards}
        part = [next(train) if shard_name("train", k) in names else np.empty(0, index.dtype),
                next(val) if shard_name("val", k) in names else np.empty(0, index.dtype)]
        length = len(part[0]) + len(part[1])
        last = k == max(len(splits["train"]), len(splits["val"])) - 1
        assert length == blocks or last  # every block but the last is full
        assert len(part[1]) == round(index.meta["val_fraction"] * length)  # its val part is its tail, F of it
        stream += part
    return np.concatenate(stream)


def documents_of(tok: Tokenizer, tokens: np.ndarray, eot: int) -> list[str]:
    """The documents a token stream holds: the text between end-of-text ids, each decoded on its own."""
    ends = np.flatnonzero(tokens == eot)
    assert len(ends) and ends[-1] == len(tokens) - 1  # every document ends with EOT, the last one too
    return [decode(tok, doc[:-1]) for doc in np.split(tokens, ends + 1)[:-1]]  # [:-1]: the empty rest


def same_files(a: Path, b: Path) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for path in a.iterdir():
        assert path.read_bytes() == (b / path.name).read_bytes(), path.name


def paragraphs(seed: int, count: int) -> list[str]:
    """`count` documents cut from the shipped text, drawn by `seed`: many documents of varied length."""
    parts = [p for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = np.random.default_rng(seed)
    return ["\n\n".join(parts[j] for j in rng.integers(0, len(parts), size=int(rng.integers(1, 4))))
            for _ in range(count)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs), encoding="utf-8")
    return path


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


def test_workers_give_the_same_bytes(tmp_path, capsys, notes_tokenizer):
    write_jsonl(tmp_path / "docs.jsonl", paragraphs(seed=2, count=1500))  # several batches of BATCH_DOCS
    for workers in (1, 2):
        code, _, err = prepare(capsys, tmp_path / "docs.jsonl", "--tokenizer", notes_tokenizer, "--shard-mb", 0.05,
                               "--workers", workers, "--out", tmp_path / f"w{workers}")
        assert code == 0, err
    same_files(tmp_path / "w1", tmp_path / "w2")
    assert len(read_corpus(tmp_path / "w2")[0].shards) > 4


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
        assert [s.sha256 for s in index.split(split)] == [s.sha256 for s in read_corpus(tmp_path / "same")[0].split(split)]


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

    # A glob is expanded by prepare, in name order, whatever the shell would have done; a directory it matches is walked.
    code, _, err = prepare(capsys, str(tree / "**" / "*.txt"), str(tree / "c.*"), "--tokenizer", notes_tokenizer,
                                "--val-fraction", 0.5, "--out", tmp_path / "glob")
    assert code == 0, err
    assert [s["path"] for s in read_corpus(tmp_path / "glob")[0].meta["sources"]] == [
        str(tree / "b" / "deeper" / "z.txt"), str(tree / "c.jsonl")]
    code, _, err = prepare(capsys, tree, str(tree / "c.*"), "--tokenizer", notes_tokenizer, "--out", tmp_path / "twice")
    assert code == 2 and f"{tree / 'c.jsonl'} (from {tree} and {tree / 'c.*'}) is given twice" in err


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


# ---- interrupted and resumed -----------------------------------------------------------------------------


def _corpus_args(tmp_path: Path, tokenizer: Path, count: int = 400, shard_mb: float = 0.01) -> list:
    docs = tmp_path / "docs.jsonl"
    if not docs.exists():
        write_jsonl(docs, paragraphs(seed=4, count=count))
    return [docs, "--tokenizer", tokenizer, "--shard-mb", shard_mb, "--val-fraction", 0.2]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 7])
def test_resume_after_an_interruption_writes_what_an_uninterrupted_prepare_writes(
        tmp_path, capsys, notes_tokenizer, monkeypatch, stop_after):
    args = _corpus_args(tmp_path, notes_tokenizer)
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


def test_a_killed_prepare_resumes_to_the_same_bytes(tmp_path, capsys, notes_tokenizer):
    args = [str(a) for a in _corpus_args(tmp_path, notes_tokenizer, count=6000, shard_mb=0.02)]
    assert prepare(capsys, *args, "--out", tmp_path / "whole")[0] == 0
    cut, journal = tmp_path / "cut", tmp_path / "cut" / JOURNAL
    process = subprocess.Popen([sys.executable, "-m", "minitrain", "data", "prepare", *args, "--out", str(cut)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert not (cut / INDEX).exists() and json.loads(journal.read_text())["shards"]
    code, _, err = prepare(capsys, *args, "--out", cut, "--resume", "--workers", 2)  # --workers is no argument of the output
    assert code == 0, err
    same_files(tmp_path / "whole", cut)


def test_resume_refusals(tmp_path, capsys, notes_tokenizer, monkeypatch):
    args = _corpus_args(tmp_path, notes_tokenizer)
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
    args = _corpus_args(tmp_path, notes_tokenizer, count=20)
    assert prepare(capsys, *args, "--out", tmp_path / "o")[0] == 0
    code, _, err = prepare(capsys, *args, "--out", tmp_path / "o", "--resume")
    assert code == 2 and "already holds a finished corpus (index.json); nothing to resume" in err


# ---- stores ----------------------------------------------------------------------------------------------


def test_s3_output_holds_the_same_shards(tmp_path, capsys, notes_tokenizer):
    args = _corpus_args(tmp_path, notes_tokenizer, count=100)
    assert prepare(capsys, *args, "--out", tmp_path / "local")[0] == 0
    with s3_server("prepared") as fs:
        capsys.readouterr()  # the server's greeting
        code, stdout, err = prepare(capsys, *args, "--workers", 2, "--out", "s3://prepared/corpus/v1")
        assert code == 0, err
        assert stdout.startswith("wrote s3://prepared/corpus/v1: ") and "s3://prepared/corpus/v1/tokenizer.json" in stdout
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


def test_a_tokenizer_that_cannot_encode_removes_what_it_wrote(tmp_path, capsys):
    from tokenizers import models

    tok = Tokenizer(models.WordLevel({"known": 0}))  # no [UNK]: any other word fails to encode
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "words.json"))
    code, _, err = prepare(capsys, _write(tmp_path, "a.txt", "known unknown"), "--tokenizer", tmp_path / "words.json",
                           "--out", tmp_path / "o")
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


# ---- the token-file format of earlier versions, still read -----------------------------------------------


@pytest.fixture
def prepared(tmp_path):
    """A corpus directory in token_files' format (train.bin, val.bin, meta.json), as earlier versions wrote it."""
    directory = tmp_path / "corpus"
    directory.mkdir()
    tok = notes_bpe()
    ids = np.array([*encode(tok, "some text " * 50), eot_id(tok)])
    n_val = round(0.1 * len(ids))
    token_files.write_split(token_files.split_path(directory, "train"), ids[:-n_val], np.uint16)
    token_files.write_split(token_files.split_path(directory, "val"), ids[-n_val:], np.uint16)
    tok.save(str(directory / "tokenizer.json"))
    meta = {"format": token_files.FORMAT, "vocab_size": 512, "dtype": "uint16", "train_tokens": len(ids) - n_val,
            "val_tokens": n_val, "val_fraction": 0.1, "tokenizer": "tokenizer.json", "eot_id": eot_id(tok),
            "documents": 1, "sources": [{"path": "ok.txt", "bytes": 500, "documents": 1}]}
    (directory / token_files.META).write_text(json.dumps(meta))
    assert token_files.read_meta(directory) == meta
    return directory


def test_open_split_is_read_only(prepared):
    assert token_files.is_prepared_dir(prepared) and not token_files.is_prepared_dir(prepared / "train.bin")
    train = token_files.open_split(prepared, "train")
    with pytest.raises(ValueError):
        train[0] = 1


def _tamper_meta(directory: Path, **changes) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    meta.update(changes)
    meta = {k: v for k, v in meta.items() if v is not ...}  # ... deletes a key
    (directory / "meta.json").write_text(json.dumps(meta))


TAMPERING = {  # name: (what to do to the directory, what the message says)
    "no meta.json": (lambda d: (d / "meta.json").unlink(), "holds no meta.json"),
    "not JSON": (lambda d: _write(d, "meta.json", "{"), "is not JSON"),
    "wrong format": (lambda d: _tamper_meta(d, format="nanogpt"), "expected 'minitrain-tokens/1'"),
    "missing key": (lambda d: _tamper_meta(d, val_tokens=...), "lacks val_tokens"),
    "wrong type": (lambda d: _tamper_meta(d, vocab_size="300"), "vocab_size is '300', not an integer"),
    "dtype and vocab disagree": (lambda d: _tamper_meta(d, dtype="uint32"), "does not go with dtype uint32"),
    "truncated train.bin": (lambda d: _write(d, "train.bin", (d / "train.bin").read_bytes()[:-2]), "train.bin has"),
    "missing val.bin": (lambda d: (d / "val.bin").unlink(), "val.bin is missing"),
}


@pytest.mark.parametrize("case", TAMPERING)
def test_read_meta_refuses_an_unsound_directory(prepared, case):
    tamper, message = TAMPERING[case]
    tamper(prepared)
    with pytest.raises(ConfigError) as e:
        token_files.read_meta(prepared)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_read_meta_refuses_what_is_not_a_directory(prepared):
    for path in (prepared / "train.bin", prepared / "absent"):
        with pytest.raises(ConfigError, match="is not a directory"):
            token_files.read_meta(path)


def test_a_copied_directory_reads_the_same(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    assert np.array_equal(token_files.open_split(copy, "val"), token_files.open_split(prepared, "val"))
