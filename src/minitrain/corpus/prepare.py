"""`minitrain data prepare`: text files in, a tokenized corpus directory out (the format of token_files).

Every check that can be made before writing is made before writing: the options, --out, each input's
existence, encoding and (for .jsonl) every line, and the tokenizer. Then the inputs are read again to train
the BPE (with --vocab-size) and once more to encode them, so that no input has to fit in memory beside its
tokens. The output is written into a temporary sibling of --out and renamed to it at the end: --out holds all
of it or, on any error, nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import token_files
from ..errors import ConfigError
from ..utils.progress import byte_bar

TOKENIZER_FILE = "tokenizer.json"
MAX_VAL_FRACTION = 0.5
# Documents are encoded in batches (tokenizers spreads a batch over all cores) of at most this many
# documents or characters, whichever comes first, so a batch's tokens stay small beside the input.
BATCH_DOCS, BATCH_CHARS = 1024, 1 << 24

DESCRIPTION = ("Tokenize text files into a corpus that `minitrain train --corpus DIR` trains on: train a "
               "byte-level BPE on them (--vocab-size) or use an existing tokenizer (--tokenizer), split the token "
               "stream into train and val, and write token files nanoGPT-style.")
EPILOG = """\
Writes into DIR, all of it or, on any error, nothing:
  train.bin, val.bin  token ids, raw little-endian uint16 (uint32 for more than 65,536 ids);
                      val.bin is the last --val-fraction of the token stream
  tokenizer.json      the tokenizer, for Hugging Face `tokenizers` (Tokenizer.from_file) or transformers
  meta.json           vocab_size, dtype, token counts, eot_id, and the inputs with their sizes

Each text file is one document; each line of a .jsonl file is one, its text in --text-field. Every document
ends with <|endoftext|> (when the tokenizer has that token). A trained BPE holds all 256 bytes, so any text
encodes, and decoding gives it back exactly.

Examples:
  minitrain data prepare src/minitrain/corpora/field_notes.txt --vocab-size 512 --out data/notes
  minitrain train --corpus data/notes --steps 200 --out runs/notes
  minitrain data prepare posts.jsonl --text-field body --tokenizer data/notes/tokenizer.json --out data/posts
                                             # the same tokenizer, so the same ids as data/notes
"""


def add_parser(sub) -> argparse.ArgumentParser:
    """Add `data prepare` to the `minitrain` subcommands `sub`; returns the `data` parser."""
    data = sub.add_parser("data", help="tokenize text files into a corpus directory",
                          description="Turn text into the token files `minitrain train --corpus DIR` reads.")
    # type(data) is the CLI's one-line-error parser class, without importing the CLI (which imports this module).
    actions = data.add_subparsers(dest="data", required=True, parser_class=type(data), metavar="ACTION")
    prepare = actions.add_parser("prepare", help="text files -> train.bin, val.bin, tokenizer.json, meta.json",
                                 description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare.add_argument("inputs", nargs="+", metavar="INPUT",
                         help="UTF-8 text files, one document each, or .jsonl files, one document a line")
    prepare.add_argument("--out", required=True, metavar="DIR", help="the directory to create (absent or empty)")
    prepare.add_argument("--vocab-size", type=int, metavar="N",
                         help="train a byte-level BPE of N ids on the inputs (at least 257: 256 bytes + <|endoftext|>)")
    prepare.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer.json instead of training one")
    prepare.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                         help=f"the share of tokens held out as val.bin, in (0, {MAX_VAL_FRACTION}] (default 0.1)")
    prepare.add_argument("--text-field", default="text", metavar="NAME",
                         help="the field of each .jsonl object that holds its text (default text)")
    return data


@dataclass
class Source:
    """One input file, as meta.json lists it."""

    path: str  # as the user spelt it
    jsonl: bool
    bytes: int
    documents: int = 0
    text_bytes: int = 0  # UTF-8 bytes of document text (a .jsonl file's JSON syntax not counted)


def run(args) -> int:
    """Carry out `minitrain data prepare`; ConfigError (one line) for bad input. Returns the exit code, 0."""
    # `tokenizers` is imported by this command only, not by every `minitrain` command.
    from . import tokenizer as tokenizers_glue

    _check_options(args)
    out = _check_out(args.out)
    sources = [_check_input(name) for name in args.inputs]
    tok = tokenizers_glue.load_tokenizer(args.tokenizer) if args.tokenizer else None
    _survey(sources, args.text_field)
    if tok is None:
        tok = tokenizers_glue.train_bpe(_documents(sources, args.text_field, "training BPE"), args.vocab_size,
                                        text_bytes=sum(s.text_bytes for s in sources))
    vocab = tokenizers_glue.vocab_size(tok)
    if vocab > tokenizers_glue.MAX_VOCAB:
        raise ConfigError(f"tokenizer {args.tokenizer} has {vocab} ids; at most {tokenizers_glue.MAX_VOCAB} fit a "
                          "token file")
    dtype, eot = token_files.dtype_for(vocab), tokenizers_glue.eot_id(tok)

    with _staging(out) as tmp:
        stream = tmp / "tokens.tmp"
        total = _encode_to(stream, tok, _documents(sources, args.text_field, "encoding"), eot, dtype)
        n_train, n_val = _split_sizes(total, args.val_fraction)
        _split_file(stream, n_train, dtype, tmp)
        tok.save(str(tmp / TOKENIZER_FILE))
        meta = _meta(vocab, dtype, n_train, n_val, args.val_fraction, eot, sources)
        (tmp / token_files.META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    documents = meta["documents"]
    print(f"wrote {args.out}: {n_train:,} train + {n_val:,} val tokens from {documents:,} "
          f"document{'s' * (documents != 1)}, vocab {vocab:,}, {dtype.name}; tokenizer "
          f"{Path(args.out) / TOKENIZER_FILE}")
    return 0


def _meta(vocab: int, dtype: np.dtype, n_train: int, n_val: int, val_fraction: float, eot: int | None,
          sources: list[Source]) -> dict:
    """meta.json's content (token_files.META_KEYS lists its keys and types)."""
    return {"format": token_files.FORMAT, "vocab_size": vocab, "dtype": dtype.name, "train_tokens": n_train,
            "val_tokens": n_val, "val_fraction": val_fraction, "tokenizer": TOKENIZER_FILE, "eot_id": eot,
            "documents": sum(s.documents for s in sources),
            "sources": [{"path": s.path, "bytes": s.bytes, "documents": s.documents} for s in sources]}


# ---- checks made before anything is written ------------------------------------------------------------


def _check_options(args) -> None:
    from .tokenizer import check_vocab_size

    if (args.vocab_size is None) == (args.tokenizer is None):
        raise ConfigError("give either --vocab-size N (train a byte-level BPE on the inputs) or --tokenizer "
                          "PATH (use an existing tokenizer.json)" + (", not both" if args.tokenizer else ""))
    if args.vocab_size is not None:
        check_vocab_size(args.vocab_size)
    if not 0 < args.val_fraction <= MAX_VAL_FRACTION:  # also false for nan
        raise ConfigError(f"--val-fraction must lie in (0, {MAX_VAL_FRACTION}], got {args.val_fraction}")
    seen: set[str] = set()
    for name in args.inputs:  # the same text twice would put the val split's text in train too
        key = os.path.realpath(name)
        if key in seen:
            raise ConfigError(f"{name} is given twice; each input once (a repeat would leak the val split into train)")
        seen.add(key)


def _check_out(name: str) -> Path:
    # abspath, not resolve: it spells out "." and ".." for the sibling's name without following symlinks.
    out = Path(os.path.abspath(name))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {name} is a file; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {name} already exists and is not empty; choose another --out or delete it")
    return out


def _check_input(name: str) -> Source:
    path = Path(name)
    if path.is_dir():
        raise ConfigError(f"input {name} is a directory; give the files in it (e.g. {path / '*.txt'})")
    if not path.is_file():
        raise ConfigError(f"input {name} does not exist")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"input {name} is not readable")
    return Source(path=name, jsonl=path.suffix.lower() == ".jsonl", bytes=path.stat().st_size)


def _survey(sources: list[Source], field: str) -> None:
    """Read every input once, checking every document, and count the documents and their text."""
    with _progress(sources, "checking") as bar:
        for source in sources:
            for text, size in _read_documents(source, field):
                source.documents += 1
                source.text_bytes += len(text.encode("utf-8"))
                bar.update(size)
            if source.text_bytes == 0:
                inside = f' (no line has a non-empty "{field}")' if source.documents else ""
                raise ConfigError(f"input {source.path} holds no text{inside}; give files with text in them")


# ---- reading ---------------------------------------------------------------------------------------------


def _read_documents(source: Source, field: str) -> Iterator[tuple[str, int]]:
    """(text, bytes of the file it took) for each document in `source`; ConfigError at the first bad one."""
    if source.jsonl:
        yield from _read_jsonl(source.path, field)
        return
    raw = Path(source.path).read_bytes()  # bytes, so that no newline translation alters the text
    try:
        yield raw.decode("utf-8"), len(raw)
    except UnicodeDecodeError as e:
        raise ConfigError(f"input {source.path} is not UTF-8 text (byte {e.start} is invalid); convert it to "
                          "UTF-8 first") from None


JSON_TYPES = {dict: "an object", list: "an array", int: "a number", float: "a number", bool: "true or false",
              type(None): "null"}


def _read_jsonl(name: str, field: str) -> Iterator[tuple[str, int]]:
    with open(name, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{name}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark may open a file
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: not UTF-8 text (byte {e.start} of the line is invalid)") from None
            if not line.strip():
                continue  # blank lines, such as a final empty one, hold no document
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not JSON ({e.msg}); each line of a .jsonl file is one JSON "
                                  "object") from None
            if not isinstance(record, dict) or field not in record:
                raise ConfigError(f'{where}: no "{field}" field; name the field that holds the text with '
                                  "--text-field")
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(f'{where}: "{field}" is {JSON_TYPES.get(type(text), "not text")}, not a string')
            yield text, len(raw)


def _progress(sources: list[Source], desc: str):
    """A bar over the inputs' bytes (progress.byte_bar: on a terminal only, so logs stay clean)."""
    return byte_bar(sum(s.bytes for s in sources), desc, always=True)


def _documents(sources: list[Source], field: str, desc: str) -> Iterator[str]:
    """Every document's text, in input order, with a progress bar."""
    with _progress(sources, desc) as bar:
        for source in sources:
            for text, size in _read_documents(source, field):
                yield text
                bar.update(size)


# ---- writing ---------------------------------------------------------------------------------------------


def _encode_to(path: Path, tok, documents: Iterator[str], eot: int | None, dtype: np.dtype) -> int:
    """Append each document's ids, then `eot`, to `path`; returns how many ids were written."""
    written, batch, chars = 0, [], 0
    with open(path, "wb") as f:
        for text in documents:
            batch.append(text)
            chars += len(text)
            if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                written += _write_batch(f, tok, batch, eot, dtype)
                batch, chars = [], 0
        written += _write_batch(f, tok, batch, eot, dtype)
    return written


def _write_batch(f, tok, texts: list[str], eot: int | None, dtype: np.dtype) -> int:
    from .tokenizer import encode_batch

    try:
        encoded = encode_batch(tok, texts)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception, e.g. WordLevel without [UNK]
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"the tokenizer cannot encode the input: {reason}") from None
    end = [] if eot is None else [eot]
    flat = [np.asarray(ids + end, dtype=np.int64) for ids in encoded]
    return token_files.write_split(f, np.concatenate(flat) if flat else np.empty(0, np.int64), dtype)


def _split_sizes(total: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) token counts: val is round(total x val_fraction), and each needs an (input, target) pair."""
    n_val = round(total * val_fraction)
    n_train = total - n_val
    if min(n_train, n_val) < token_files.MIN_SPLIT_TOKENS:
        fix = "more text or a larger --val-fraction" if n_val < token_files.MIN_SPLIT_TOKENS else "more text"
        raise ConfigError(f"the inputs make {total} tokens: {n_train} for train and {n_val} for val, and each "
                          f"needs at least {token_files.MIN_SPLIT_TOKENS}; give {fix}")
    return n_train, n_val


def _split_file(stream: Path, n_train: int, dtype: np.dtype, directory: Path) -> None:
    """Cut the token stream into val.bin (its tail, copied) and train.bin (the stream itself, truncated and
    renamed), so the tokens are on disk once plus the val share, never twice."""
    tail = np.memmap(stream, dtype=dtype, mode="r", offset=n_train * dtype.itemsize)
    token_files.write_split(token_files.split_path(directory, "val"), tail, dtype)
    del tail  # unmap before truncating the file under it
    os.truncate(stream, n_train * dtype.itemsize)
    os.rename(stream, token_files.split_path(directory, "train"))


def _make_parents(directory: Path, made: list[Path]) -> None:
    """mkdir -p `directory`, appending each directory to `made` as it is made (outermost first), so that a
    failure half way still knows what to remove."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        d.mkdir()
        made.append(d)


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out` to write into, renamed to `out` when the block succeeds. On any error it is
    removed, with the parent directories made for it, and an OSError becomes a one-line ConfigError."""
    made: list[Path] = []
    tmp = None
    try:
        _make_parents(out.parent, made)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        tmp.mkdir()  # not mkdtemp: its 0700 would become --out's mode; mkdir gives the umask's, as for any folder
        yield tmp
        os.rename(tmp, out)  # replaces an empty directory; fails if --out filled up meanwhile
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        if isinstance(e, OSError):
            raise ConfigError(f"cannot write {out}: {e}") from None
        raise
