"""`minitrain data prepare`: text in, a sharded corpus out (the format of shard_index), locally or in a store.

The checks that need no pass over the inputs come before anything is written: the options, --out, each input's
existence, and the tokenizer. Then the inputs are read once, each document checked as it is read, and encoded
(encode_pool) into shards (shard_writer), one block at a time, each block followed by the journal that --resume
continues from. With --vocab-size they are read twice before that: to check and count the text, then to train the
BPE, whose tokenizer.json is written into the output before encoding starts. index.json comes last: a corpus
without it is unfinished, and nothing reads it.

A fresh prepare that fails on its input or its tokenizer (a bad line found late included) removes what it wrote;
one that is interrupted, killed or cannot write keeps its shards and journal for --resume.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import sys

import numpy as np

from ..errors import ConfigError
from . import encode_pool, inputs, prepare_out, token_files
from .shard_index import FORMAT, INDEX, ShardIndex
from .shard_writer import JOURNAL, Journal, ShardWriter, difference

TOKENIZER_FILE = "tokenizer.json"
MAX_VAL_FRACTION = 0.5
DEFAULT_SHARD_MB = 256
MIN_SHARD_BYTES = 1024

DESCRIPTION = ("Tokenize text into a sharded corpus that `minitrain train --corpus DIR|URL` trains on: train a "
               "byte-level BPE on it (--vocab-size) or use an existing tokenizer (--tokenizer), and write the token "
               "stream as train and val shards of at most --shard-mb each, to a directory or an s3:// prefix.")
EPILOG = """\
Inputs: a text file is one document; each line of a .jsonl file is one, and each row of a .parquet file
(pip install 'minitrain[data]'), their text in --text-field. A directory is walked recursively in name order,
taking its .txt, .md, .text, .rst, .jsonl and .parquet files; a glob ('data/**/*.jsonl', quoted) is expanded
here, in name order. Every document ends with <|endoftext|> (when the tokenizer has that token). A trained BPE
holds all 256 bytes, so any text encodes, and decoding gives it back exactly.

Writes into DIR (or the store prefix):
  train-00000.bin, ...  token ids, raw little-endian uint16 (uint32 for more than 65,536 ids), at most
  val-00000.bin, ...    --shard-mb each. The token stream is cut into blocks of --shard-mb; the last
                        --val-fraction of each block is its val shard, the rest its train shard
  tokenizer.json        the tokenizer, for Hugging Face `tokenizers` (Tokenizer.from_file) or transformers
  index.json            written last: vocab_size, dtype, eot_id, val_fraction, shard_bytes, the inputs, and
                        each shard's split, token count and sha256. Without it the corpus is unfinished.
  prepare.json          while it runs only: the journal --resume continues from (removed at the end)

The shards are the same bytes whatever --workers is, and whatever interruptions --resume went through.

Examples:
  minitrain data prepare src/minitrain/corpora/field_notes.txt --vocab-size 512 --out data/notes
  minitrain train --corpus data/notes --steps 200 --out runs/notes
  minitrain data prepare posts.jsonl --text-field body --tokenizer data/notes/tokenizer.json --out data/posts
                                             # the same tokenizer, so the same ids as data/notes
  minitrain data prepare crawl/ 'more/*.parquet' --vocab-size 32768 --workers 8 --out s3://bucket/crawl
  minitrain data prepare crawl/ 'more/*.parquet' --vocab-size 32768 --workers 8 --out s3://bucket/crawl --resume
                                             # after a Ctrl-C or a crash: continues from the last shard
"""


def add_parser(sub) -> argparse.ArgumentParser:
    """Add `data prepare` to the `minitrain` subcommands `sub`; returns the `data` parser."""
    data = sub.add_parser("data", help="tokenize text into a sharded corpus",
                          description="Turn text into the token shards `minitrain train --corpus DIR` reads.")
    # type(data) is the CLI's one-line-error parser class, without importing the CLI (which imports this module).
    actions = data.add_subparsers(dest="data", required=True, parser_class=type(data), metavar="ACTION")
    prepare = actions.add_parser("prepare", help="text -> train/val shards, tokenizer.json, index.json",
                                 description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare.add_argument("inputs", nargs="+", metavar="INPUT",
                         help="text files (one document each), .jsonl or .parquet files (one document a line or "
                              "row), directories of them, or quoted globs")
    prepare.add_argument("--out", required=True, metavar="DIR|URL",
                         help="the directory or store prefix (s3://bucket/prefix) to write; absent or empty, or "
                              "holding an unfinished prepare with --resume")
    prepare.add_argument("--vocab-size", type=int, metavar="N",
                         help="train a byte-level BPE of N ids on the inputs (at least 257: 256 bytes + <|endoftext|>)")
    prepare.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer.json instead of training one")
    prepare.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                         help=f"the share of each block held out as val, in (0, {MAX_VAL_FRACTION}] (default 0.1)")
    prepare.add_argument("--text-field", default="text", metavar="NAME",
                         help="the .jsonl field or .parquet column that holds the text (default text)")
    prepare.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB, metavar="N",
                         help="the most MiB (2**20 bytes) a shard holds, fractions allowed "
                              f"(default {DEFAULT_SHARD_MB})")
    prepare.add_argument("--workers", type=int, default=1, metavar="W",
                         help="tokenize in W processes, one core each (default 1)")
    prepare.add_argument("--resume", action="store_true",
                         help="continue the unfinished prepare in --out (same arguments) from its last shard")
    return data


def run(args) -> int:
    """Carry out `minitrain data prepare`; ConfigError (one line) for bad input. Returns the exit code, 0."""
    _check_options(args)
    out = prepare_out.open_out(args.out)
    try:
        return _prepare(args, out)
    finally:
        out.close()


def _prepare(args, out) -> int:
    # `tokenizers` is imported by this command only, not by every `minitrain` command.
    from . import tokenizer as tokenizers_glue

    journal = _check_out(out, args.resume)
    sources = inputs.expand(args.inputs)
    if any(s.kind == inputs.PARQUET for s in sources):
        inputs.import_pyarrow_parquet()
    given = tokenizers_glue.load_tokenizer(args.tokenizer) if args.tokenizer else None
    shard_bytes = int(args.shard_mb * 2**20)
    fingerprint = {"inputs": [[s.path, s.bytes] for s in sources], "vocab_size": args.vocab_size,
                   "tokenizer": _file_sha256(args.tokenizer) if args.tokenizer else None,
                   "shard_bytes": shard_bytes, "val_fraction": args.val_fraction, "text_field": args.text_field}
    if journal is not None:
        _check_resumable(out, journal, fingerprint)
    resumable = journal is not None  # whether the output holds a journal, so that a failure may keep it
    written = [TOKENIZER_FILE, JOURNAL]  # what a failed fresh prepare removes, shards added as they are written
    try:
        if journal is None:
            if given is None:  # the trainer sizes its tables by the text: a pass to count it (and check it) first
                inputs.survey(sources, args.text_field)
            tok = given or tokenizers_glue.train_bpe(inputs.documents(sources, args.text_field, "training BPE"),
                                                     args.vocab_size, text_bytes=sum(s.text_bytes for s in sources))
            _check_vocab(tokenizers_glue.vocab_size(tok), args.tokenizer)
            tokenizer_json = tok.to_str(pretty=True).encode("utf-8")
            journal = Journal(fingerprint, hashlib.sha256(tokenizer_json).hexdigest())
            out.create()
            out.write_bytes(TOKENIZER_FILE, tokenizer_json)
            out.write_bytes(JOURNAL, journal.to_json().encode("utf-8"))
            resumable = True
        # Every process encodes with the file the corpus ships, this one too.
        tok = tokenizers_glue.load_tokenizer(out.local_path(TOKENIZER_FILE))
        vocab = tokenizers_glue.vocab_size(tok)
        dtype, eot = token_files.dtype_for(vocab), tokenizers_glue.eot_id(tok)
        block = shard_bytes // dtype.itemsize
        written += [s.name for s in journal.shards]
        _check_journal_shards(out, journal, dtype, block)
        _encode_and_write(args, out, journal, sources, written, eot, dtype, block)
        n_train, n_val = _check_split(journal)
        meta = {"format": FORMAT, "vocab_size": vocab, "dtype": dtype.name, "eot_id": eot, "tokenizer": TOKENIZER_FILE,
                "val_fraction": args.val_fraction, "shard_bytes": shard_bytes,
                "documents": sum(s.documents for s in sources),
                "sources": [{"path": s.path, "bytes": s.bytes, "documents": s.documents} for s in sources]}
        out.write_bytes(INDEX, ShardIndex(out.where, meta, tuple(journal.shards)).to_json().encode("utf-8"))
    except (prepare_out.WriteError, encode_pool.WorkerDied) as e:
        if not resumable:
            out.discard(written)
            raise
        raise prepare_out.WriteError(f"{e}; what is written is kept: add --resume once that is fixed") from None
    except ConfigError:
        if not args.resume:  # it would fail again the same way: a resume has nothing to gain from the shards
            out.discard([*written, INDEX])
        raise
    except KeyboardInterrupt:
        if resumable:
            print(f"minitrain data: the shards written so far are kept in {args.out}; add --resume to the same "
                  "command to continue", file=sys.stderr)
        else:  # before the journal: nothing to resume from
            out.discard(written)
        raise
    out.remove(JOURNAL)
    documents, shards = meta["documents"], len(journal.shards)
    print(f"wrote {args.out}: {n_train:,} train + {n_val:,} val tokens in {shards:,} shard{'s' * (shards != 1)} "
          f"from {documents:,} document{'s' * (documents != 1)}, vocab {vocab:,}, {dtype.name}; tokenizer "
          f"{out.location(TOKENIZER_FILE)}")
    return 0


def _encode_and_write(args, out, journal: Journal, sources, written: list[str], eot: int | None,
                      dtype: np.dtype, block: int) -> None:
    """Encode every document the journal has not consumed into shards, rewriting the journal after each block."""
    writer = ShardWriter(out, dtype, block, args.val_fraction, first_block=journal.blocks)
    consumed, drop = journal.documents, journal.offset  # drop: tokens of the next document already written
    documents = inputs.documents(sources, args.text_field, "encoding", skip=journal.documents)
    try:
        for flat, lengths in encode_pool.encoded(documents, str(out.local_path(TOKENIZER_FILE)), eot, dtype,
                                                 args.workers):
            ends, at = np.cumsum(lengths), 0
            if drop:
                if not len(lengths) or lengths[0] < drop:
                    raise ConfigError("the inputs no longer hold what the interrupted prepare wrote; start again "
                                      "in an empty --out")
                at, drop = drop, 0
            while at < len(flat):
                take = min(writer.room, len(flat) - at)
                writer.add(flat[at:at + take])
                at += take
                if writer.room == 0:
                    _block_done(out, journal, writer.end_block(), written, writer.block,
                                consumed, ends, at)
            consumed += len(lengths)
        if writer.filled:
            shards = writer.end_block()
            journal.shards += shards
            written += [s.name for s in shards]
    finally:
        writer.close()


def _block_done(out, journal: Journal, shards, written: list[str], blocks: int, consumed: int,
                ends: np.ndarray, at: int) -> None:
    """Record a published block in the journal: the documents it finished, and the tokens of the next it holds."""
    whole = int(np.searchsorted(ends, at, side="right"))  # documents of this batch that end at or before `at`
    journal.shards += shards
    written += [s.name for s in shards]
    journal.blocks, journal.documents = blocks, consumed + whole
    journal.offset = at - (int(ends[whole - 1]) if whole else 0)
    out.write_bytes(JOURNAL, journal.to_json().encode("utf-8"))


def _check_split(journal: Journal) -> tuple[int, int]:
    """(train, val) token counts; each split needs an (input, target) pair."""
    n_train = sum(s.tokens for s in journal.shards if s.split == "train")
    n_val = sum(s.tokens for s in journal.shards if s.split == "val")
    if min(n_train, n_val) < token_files.MIN_SPLIT_TOKENS:
        fix = "more text or a larger --val-fraction" if n_val < token_files.MIN_SPLIT_TOKENS else "more text"
        raise ConfigError(f"the inputs make {n_train + n_val} tokens: {n_train} for train and {n_val} for val, and "
                          f"each needs at least {token_files.MIN_SPLIT_TOKENS}; give {fix}")
    return n_train, n_val


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
    if not (math.isfinite(args.shard_mb) and args.shard_mb * 2**20 >= MIN_SHARD_BYTES):
        raise ConfigError(f"--shard-mb must be at least {MIN_SHARD_BYTES / 2**20:.6g} ({MIN_SHARD_BYTES} bytes), "
                          f"got {args.shard_mb}")
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")


def _check_vocab(vocab: int, path: str | None) -> None:
    from .tokenizer import MAX_VOCAB

    if vocab > MAX_VOCAB:
        raise ConfigError(f"tokenizer {path} has {vocab} ids; at most {MAX_VOCAB} fit a token file")


def _check_out(out, resume: bool) -> Journal | None:
    """The journal to continue from (with --resume), or None for a fresh prepare into an absent or empty --out."""
    names = out.names()
    if INDEX in names:
        raise ConfigError(f"--out {out.where} already holds a finished corpus ({INDEX})"
                          + ("; nothing to resume" if resume else "; choose another --out or delete it"))
    if resume:
        data = out.read_bytes(JOURNAL) if JOURNAL in names else None
        if data is None:
            raise ConfigError(f"--resume: --out {out.where} holds no unfinished prepare (no {JOURNAL}); leave out "
                              "--resume to start one")
        return Journal.parse(data, out.location(JOURNAL))
    if JOURNAL in names:
        raise ConfigError(f"--out {out.where} holds an unfinished prepare ({JOURNAL}); add --resume to continue it "
                          "with the same arguments, or choose another --out")
    if names:
        raise ConfigError(f"--out {out.where} already exists and is not empty; choose another --out or delete it")
    return None


def _check_resumable(out, journal: Journal, fingerprint: dict) -> None:
    """--resume continues only the same prepare: the same inputs, tokenizer and options, its files intact."""
    changed = difference(fingerprint, journal.fingerprint)
    if changed:
        raise ConfigError(f"--resume with other arguments than the unfinished prepare in {out.where}: {changed}; give "
                          "the same ones, or start again in an empty --out")
    tokenizer_json = out.read_bytes(TOKENIZER_FILE)
    if tokenizer_json is None or hashlib.sha256(tokenizer_json).hexdigest() != journal.tokenizer_sha256:
        raise ConfigError(f"{out.location(TOKENIZER_FILE)} is missing or changed since the prepare began; start "
                          "again in an empty --out")
    out.remove_temporaries()


def _check_journal_shards(out, journal: Journal, dtype: np.dtype, block: int) -> None:
    if sum(s.tokens for s in journal.shards) != journal.blocks * block:
        raise ConfigError(f"{out.location(JOURNAL)} does not add up ({journal.blocks} blocks of {block} tokens); "
                          "start again in an empty --out")
    for shard in journal.shards:
        size = out.size(shard.name)
        if size != shard.tokens * dtype.itemsize:
            raise ConfigError(f"{out.location(shard.name)}, which the journal lists, is "
                              f"{'missing' if size is None else f'{size} bytes, not {shard.tokens * dtype.itemsize}'}"
                              "; start again in an empty --out")


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
