"""Tokenizers for `minitrain data prepare`: byte-level BPE on Hugging Face `tokenizers`, and the ways in and out
of token ids. The only module that imports `tokenizers`, so the rest of minitrain runs without it.

Exact round trip, decode(encode(text)) == text for every string, rests on four settings, all made here:
  - no normalizer (one would rewrite the text before it is split);
  - the ByteLevel pre-tokenizer with add_prefix_space=False (True would invent a space before the text);
  - the ByteLevel decoder, which maps the 256 byte symbols back to bytes and decodes them as UTF-8;
  - every one of the 256 byte symbols in the vocabulary, so no text ever falls to an unknown token.
trim_offsets only moves character offsets, never ids, so it plays no part. And document text is plain text:
a literal "<|endoftext|>" inside it is encoded as characters, never as the end-of-text id (as tiktoken's
encode_ordinary does), so a document cannot forge a boundary.
"""
from __future__ import annotations

import re

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..errors import ConfigError

EOT = "<|endoftext|>"  # ends every document; the only special token minitrain adds
SPECIAL_TOKENS = (EOT,)
MIN_BPE_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte, every special token, then the merges
MAX_VOCAB = 2**32  # ids are stored as uint32 at most


def _byte_level_parts() -> tuple[pre_tokenizers.ByteLevel, decoders.ByteLevel]:
    # use_regex=True splits words the way GPT-2 does, so merges never cross a word boundary; it changes which
    # merges are learnt, never whether decoding is exact.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), decoders.ByteLevel()


def byte_symbols() -> list[str]:
    """The printable character ByteLevel writes for each byte value, indexed by byte (GPT-2's table): bytes
    that already print as one visible Latin-1 character stand for themselves, the other 68 are shifted, in
    order, to the characters from U+0100 on."""
    prints_as_itself = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    symbols, shifted = [], 256
    for byte in range(256):
        if byte in prints_as_itself:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(shifted))
            shifted += 1
    return symbols


def byte_level_tokenizer() -> Tokenizer:
    """Exactly 256 ids, id == byte value: the UTF-8 bytes of the text, as `minitrain.data.ByteTokenizer` gives
    them, but as a tokenizer.json that any Hugging Face tooling loads."""
    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = _byte_level_parts()
    return tok


def check_vocab_size(vocab_size: int) -> None:
    """ConfigError unless a byte-level BPE of this size can be trained and its ids stored."""
    if not MIN_BPE_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ConfigError(f"--vocab-size must be between {MIN_BPE_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special "
                          f"token) and {MAX_VOCAB}, got {vocab_size}")


# BPE's work on one word grows faster than its length, so one long enough line would stall the tokenizer:
# a run of more than MAX_WORD characters without white space is cut into pieces of MAX_WORD for the tokenizer.
# Ordinary text has no such run, so its tokens are what they would be uncut; decode(encode(text)) == text always.
MAX_WORD = 256
_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_WORD + 1))


def bounded_pieces(text: str) -> list[str]:
    """`text` cut into pieces that hold no run of more than MAX_WORD non-space characters (only inside such runs;
    the pieces joined are the text)."""
    pieces, at = [], 0
    for run in _LONG_RUN.finditer(text):
        if run.start() > at:
            pieces.append(text[at:run.start()])
        pieces += [text[i:min(i + MAX_WORD, run.end())] for i in range(run.start(), run.end(), MAX_WORD)]
        at = run.end()
    if at < len(text) or not pieces:
        pieces.append(text[at:])
    return pieces


def train_bpe(texts: Iterable[str], vocab_size: int, text_bytes: int | None = None) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` ids learnt from `texts`: all 256 bytes (so any text encodes),
    EOT, and merges until the size is reached or no pair repeats (then it comes out smaller).

    `text_bytes`, the UTF-8 size of `texts` (counted here for a list), bounds what the trainer reserves: it
    allocates a table of `vocab_size` entries up front, which for a request far above what the text can give
    (--vocab-size 4000000000 on 30 KB) aborts the process. Each merge joins a pair of symbols that occurs in the
    text, so there are fewer merges than bytes, and the cap changes no result. The trainer's own progress bars
    stay off: they would interleave with the caller's bar over the reading of `texts`."""
    check_vocab_size(vocab_size)
    if text_bytes is None and isinstance(texts, (list, tuple)):
        text_bytes = sum(len(text.encode("utf-8")) for text in texts)
    reserve = vocab_size if text_bytes is None else min(vocab_size, MIN_BPE_VOCAB + text_bytes)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = _byte_level_parts()
    trainer = trainers.BpeTrainer(vocab_size=reserve, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((piece for text in texts for piece in bounded_pieces(text)), trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json, or ConfigError with one line saying why it cannot be used."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tokenizer {path} {'is a directory' if path.is_dir() else 'does not exist'}; give the "
                          "path of a tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file, whatever the fault
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"cannot load tokenizer {path}: {first_line}") from None


def vocab_size(tok: Tokenizer) -> int:
    """The size an embedding table needs: all ids, added tokens included (also if the ids have gaps)."""
    highest = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    return max(tok.get_vocab_size(with_added_tokens=True), highest + 1)


def eot_id(tok: Tokenizer) -> int | None:
    """The end-of-text id, or None for a tokenizer without one (e.g. byte_level_tokenizer)."""
    return tok.token_to_id(EOT)


def _plain_text(tok: Tokenizer) -> Tokenizer:
    # Not saved in tokenizer.json, so set on every call: a special token's text in a document stays text.
    tok.encode_special_tokens = True
    return tok


def encode(tok: Tokenizer, text: str) -> list[int]:
    """The ids of one document's text, nothing added (no EOT, no post-processor tokens such as BERT's [CLS])."""
    return encode_batch(tok, [text])[0]


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """encode() of each text, on all cores (each in bounded_pieces, whose ids are laid end to end)."""
    cut = [bounded_pieces(text) for text in texts]
    encoded = iter(_plain_text(tok).encode_batch([piece for pieces in cut for piece in pieces],
                                                 add_special_tokens=False))
    return [[i for _ in pieces for i in next(encoded).ids] for pieces in cut]


def decode(tok: Tokenizer, ids: Iterable[int]) -> str:
    """The text of `ids`; special tokens are written out (EOT as "<|endoftext|>"). Bytes that are not whole
    UTF-8 characters, as at a cut through a character, come out as U+FFFD."""
    ids = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).tolist()
    return tok.decode(ids, skip_special_tokens=False)
