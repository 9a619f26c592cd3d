"""`minitrain data prepare`, the tokenizers behind it, and the token-file format it writes."""
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

import minitrain
from minitrain.corpus import token_files
from minitrain.apps.cli import main
from minitrain.errors import ConfigError
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


def read_tokens(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    return token_files.open_split(directory, "train"), token_files.open_split(directory, "val")


def documents_of(tok: Tokenizer, tokens: np.ndarray, eot: int) -> list[str]:
    """The documents a token stream holds: the text between end-of-text ids, each decoded on its own."""
    ends = np.flatnonzero(tokens == eot)
    assert len(ends) and ends[-1] == len(tokens) - 1  # every document ends with EOT, the last one too
    return [decode(tok, doc[:-1]) for doc in np.split(tokens, ends + 1)[:-1]]  # [:-1]: the empty rest


def test_prepare_the_shipped_corpus(tmp_path, capsys):
    out = tmp_path / "data" / "notes"  # parent directories are made
    code, stdout, err = prepare(capsys, CORPUS, "--vocab-size", 512, "--out", out)
    assert code == 0 and err == ""  # no progress bar off a terminal
    assert stdout.count("\n") == 1 and stdout.startswith(f"wrote {out}: ") and "vocab 512, uint16" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["notes"]  # no temporary directory left beside it

    meta = token_files.read_meta(out)
    assert json.loads((out / "meta.json").read_text()) == meta
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = CORPUS.read_text(encoding="utf-8")
    expected = [*encode(tok, text), tok.token_to_id(EOT)]
    assert meta == {"format": "minitrain-tokens/1", "vocab_size": 512, "dtype": "uint16",
                    "train_tokens": len(expected) - round(0.1 * len(expected)), "val_tokens": round(0.1 * len(expected)),
                    "val_fraction": 0.1, "tokenizer": "tokenizer.json", "eot_id": tok.token_to_id(EOT), "documents": 1,
                    "sources": [{"path": str(CORPUS), "bytes": CORPUS.stat().st_size, "documents": 1}]}
    assert encode(tok, text) == encode(notes_bpe(), text)  # the file holds the tokenizer that was trained

    train, val = read_tokens(out)
    assert train.dtype == np.uint16 and (out / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    stream = np.concatenate([train, val])
    assert stream.tolist() == expected and val.tolist() == expected[-meta["val_tokens"]:]  # val is the tail
    assert documents_of(tok, stream, meta["eot_id"]) == [text]

    # The saved tokenizer, given back with --tokenizer, makes the same files.
    again = tmp_path / "again"
    assert prepare(capsys, CORPUS, "--tokenizer", out / "tokenizer.json", "--out", again)[0] == 0
    for name in ("train.bin", "val.bin"):
        assert (again / name).read_bytes() == (out / name).read_bytes()
    assert token_files.read_meta(again)["vocab_size"] == 512


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
    meta = token_files.read_meta(out)
    assert meta["documents"] == 5 and [s["documents"] for s in meta["sources"]] == [4, 1]
    assert meta["sources"][1] == {"path": str(tmp_path / "page.md"), "bytes": 21, "documents": 1}
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    stream = np.concatenate(read_tokens(out))
    assert documents_of(tok, stream, meta["eot_id"]) == [*docs, "# a page\r\nwith CRLF\r\n"]
    assert meta["val_tokens"] == round(0.5 * len(stream)) and meta["train_tokens"] + meta["val_tokens"] == len(stream)


def test_prepare_with_the_byte_level_tokenizer(tmp_path, capsys):
    byte_level_tokenizer().save(str(tmp_path / "bytes.json"))
    text = "bytes: ünïcödé 漢字\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    assert prepare(capsys, tmp_path / "a.txt", "--tokenizer", tmp_path / "bytes.json", "--out", tmp_path / "o")[0] == 0
    meta = token_files.read_meta(tmp_path / "o")
    assert meta["vocab_size"] == 256 and meta["eot_id"] is None  # no EOT to end documents with
    assert np.concatenate(read_tokens(tmp_path / "o")).tolist() == list(text.encode("utf-8"))


def test_prepare_stores_ids_above_65535_as_uint32(tmp_path, capsys):
    tok = byte_level_tokenizer()
    tok.add_tokens([f"<w{i}>" for i in range(256, 70000)])  # ordinary added tokens: matched in text
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("x<w69999>y<w300>z", encoding="utf-8")
    code, _, err = prepare(capsys, tmp_path / "a.txt", "--tokenizer", tmp_path / "big.json", "--val-fraction", 0.5,
                           "--out", tmp_path / "o")
    assert code == 0, err
    meta = token_files.read_meta(tmp_path / "o")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70000
    train, val = read_tokens(tmp_path / "o")
    assert train.dtype == np.uint32 and np.concatenate([train, val]).tolist() == [120, 69999, 121, 300, 122]


def test_data_prepare_help_teaches(capsys):
    with pytest.raises(SystemExit) as e:
        main(["data", "prepare", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for needle in ("train.bin", "meta.json", "tokenizer.json", "--val-fraction",
                   "minitrain data prepare src/minitrain/corpora/field_notes.txt --vocab-size 512 --out data/notes",
                   "minitrain train --corpus data/notes"):
        assert needle in text


# ---- refusals: exit 2, one line, nothing written ---------------------------------------------------------


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def _ok(tmp_path):
    return _write(tmp_path, "ok.txt", "some text " * 50)


def _jsonl(tmp_path, second_line):
    return _write(tmp_path, "docs.jsonl", '{"text": "fine"}\n' + second_line + "\n")


REFUSALS = {  # name: (inputs and flags, given tmp_path; what the message says)
    "missing input": (lambda p: ["nope.txt", "--vocab-size", 300], "input nope.txt does not exist"),
    "directory input": (lambda p: [p, "--vocab-size", 300], "is a directory"),
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
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no --out, parent or temporary directory


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


# ---- reading a prepared directory ------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path, capsys):
    assert prepare(capsys, _ok(tmp_path), "--vocab-size", 300, "--out", tmp_path / "corpus")[0] == 0
    return tmp_path / "corpus"


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
