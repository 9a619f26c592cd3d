"""What the tests of `minitrain data prepare` share: the shipped text, its BPE, running the command in this
process, and reading a sharded corpus back the way a reader checks it."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import minitrain
from minitrain.apps.cli import main
from minitrain.corpus.shard_index import (
    INDEX,
    META_KEYS,
    ShardIndex,
    parse_index,
    sha256_of,
    shard_name,
)
from minitrain.corpus.shard_writer import JOURNAL
from minitrain.corpus.tokenizer import EOT, decode, train_bpe

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


def prepare(capsys, *argv) -> tuple[int, str, str]:
    code = main(["data", "prepare", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err



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



def corpus_args(tmp_path: Path, tokenizer: Path, count: int = 400, shard_mb: float = 0.01) -> list:
    """Arguments for a prepare of `count` documents (written once into tmp_path) into shards of `shard_mb`."""
    docs = tmp_path / "docs.jsonl"
    if not docs.exists():
        write_jsonl(docs, paragraphs(seed=4, count=count))
    return [docs, "--tokenizer", tokenizer, "--shard-mb", shard_mb, "--val-fraction", 0.2]
