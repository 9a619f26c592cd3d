"""The tokenizers behind `minitrain data prepare`, and the token-file format (train.bin, val.bin, meta.json) that
earlier versions of it wrote and the trainer still reads."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from minitrain.corpus import token_files
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
from tests.helpers.prepared_corpus import CORPUS, TRICKY, notes_bpe

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


# ---- the token-file format ------------------------------------------------------------------------------


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
    "not JSON": (lambda d: (d / "meta.json").write_text("{"), "is not JSON"),
    "wrong format": (lambda d: _tamper_meta(d, format="nanogpt"), "expected 'minitrain-tokens/1'"),
    "missing key": (lambda d: _tamper_meta(d, val_tokens=...), "lacks val_tokens"),
    "wrong type": (lambda d: _tamper_meta(d, vocab_size="300"), "vocab_size is '300', not an integer"),
    "dtype and vocab disagree": (lambda d: _tamper_meta(d, dtype="uint32"), "does not go with dtype uint32"),
    "truncated train.bin": (lambda d: (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:-2]),
                            "train.bin has"),
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
