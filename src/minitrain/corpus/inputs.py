"""The inputs of `minitrain data prepare`: which files the INPUT arguments name, and the documents in them.

An INPUT is a file, a directory (walked recursively in name order, taking the files whose suffix is known) or a
glob (expanded here, in name order, so that the shell's locale and its limit on arguments play no part). A text
file is one document; each line of a .jsonl file is one, its text in --text-field; so is each row of a .parquet
file's --text-field column, read a record batch at a time so that no input has to fit in memory. A document that
cannot be read (not UTF-8, not JSON, no text field) is a one-line ConfigError naming its file and line or row.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..utils.progress import byte_bar

JSONL, PARQUET = ".jsonl", ".parquet"
# What a directory walk takes: a file named explicitly (or matched by a glob) is read whatever its suffix.
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
KNOWN_SUFFIXES = (*TEXT_SUFFIXES, JSONL, PARQUET)
PARQUET_ROWS = 4096  # rows of one record batch: a bounded slice of a file of any size
PYARROW_HINT = "pip install 'minitrain[data]'"


@dataclass
class Source:
    """One input file, as the index lists it."""

    path: str  # as the user spelt it, or as a directory walk or glob found it
    bytes: int
    documents: int = 0
    text_bytes: int = 0  # UTF-8 bytes of document text (a .jsonl file's JSON syntax not counted)

    @property
    def kind(self) -> str:
        suffix = Path(self.path).suffix.lower()
        return suffix if suffix in (JSONL, PARQUET) else "text"


def expand(names: list[str]) -> list[Source]:
    """The files the INPUT arguments name, in order; ConfigError (one line) for one that names none."""
    sources: list[Source] = []
    seen: dict[str, str] = {}  # a file's real path: the argument that named it
    for name in names:
        for path in _files_of(name):
            key = os.path.realpath(path)
            if key in seen:  # the same text twice would put the val split's text in train too
                twice = path if seen[key] == path == name else f"{path} (from {seen[key]} and {name})"
                raise ConfigError(f"{twice} is given twice; each input once (a repeat would leak the val split "
                                  "into train)")
            seen[key] = name
            sources.append(_source(path))
    return sources


def _files_of(name: str) -> list[str]:
    path = Path(name)
    if not path.exists() and any(c in name for c in "*?["):
        matches = sorted(glob.glob(name, recursive=True))
        if not matches:
            raise ConfigError(f"input {name} matches no file")
        return [found for match in matches for found in (_walk(match) if Path(match).is_dir() else [match])]
    if path.is_dir():
        return _walk(name)
    if not path.exists():
        raise ConfigError(f"input {name} does not exist")
    return [name]


def _walk(directory: str) -> list[str]:
    """The files under `directory` with a known suffix, in the order of their paths' parts (a/b.txt before
    a.txt's sibling b/, as `find | sort` would not); hidden files and folders are skipped."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, f) for f in files
                  if not f.startswith(".") and Path(f).suffix.lower() in KNOWN_SUFFIXES]
    found.sort(key=lambda path: Path(path).relative_to(directory).parts)
    if not found:
        raise ConfigError(f"input {directory} is a directory holding no {', '.join(KNOWN_SUFFIXES)} file")
    return found


def _source(name: str) -> Source:
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"input {name} is not a regular file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"input {name} is not readable")
    return Source(path=name, bytes=path.stat().st_size)


def survey(sources: list[Source], field: str) -> None:
    """Read every input once, checking every document, and count the documents and their text (what a BPE
    training needs to know before it starts)."""
    with progress(sources, "checking") as bar:
        for source in sources:
            source.documents = source.text_bytes = 0
            for text, size in read_documents(source, field):
                source.documents += 1
                source.text_bytes += len(text.encode("utf-8"))
                bar.update(size)
            if source.text_bytes == 0:
                raise _no_text(source, field)


def _no_text(source: Source, field: str) -> ConfigError:
    unit = "row" if source.kind == PARQUET else "line"
    inside = f' (no {unit} has a non-empty "{field}")' if source.documents else ""
    return ConfigError(f"input {source.path} holds no text{inside}; give files with text in them")


def progress(sources: list[Source], desc: str):
    """A bar over the inputs' bytes (progress.byte_bar: on a terminal only, so logs stay clean)."""
    return byte_bar(sum(s.bytes for s in sources), desc, always=True)


def documents(sources: list[Source], field: str, desc: str, skip: int = 0) -> Iterator[str]:
    """Every document's text, in input order, with a progress bar, counting each source's documents as it goes
    (ConfigError for a source without text). The first `skip` documents are read and counted, not returned."""
    with progress(sources, desc) as bar:
        for source in sources:
            source.documents, has_text = 0, False
            for text, size in read_documents(source, field):
                source.documents += 1
                has_text = has_text or bool(text)
                if skip:
                    skip -= 1
                else:
                    yield text
                bar.update(size)
            if not has_text:
                raise _no_text(source, field)


def read_documents(source: Source, field: str) -> Iterator[tuple[str, int]]:
    """(text, bytes of the file it took) for each document in `source`; ConfigError at the first bad one."""
    if source.kind == JSONL:
        yield from _read_jsonl(source.path, field)
    elif source.kind == PARQUET:
        yield from _read_parquet(source.path, field)
    else:
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


def import_pyarrow_parquet():
    """pyarrow.parquet, imported only when a .parquet input is given; ConfigError naming the extra if absent."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f".parquet inputs need pyarrow, which is not installed: {PYARROW_HINT}") from None
    return pq


def _read_parquet(name: str, field: str) -> Iterator[tuple[str, int]]:
    import pyarrow as pa

    pq = import_pyarrow_parquet()
    try:
        reader = pq.ParquetFile(name)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"cannot read {name} as parquet: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None
    schema = reader.schema_arrow
    if field not in schema.names:
        shown = ", ".join(schema.names[:8]) + (", ..." if len(schema.names) > 8 else "")
        raise ConfigError(f'{name}: no column "{field}" (it has {shown or "none"}); name the column that holds the '
                          "text with --text-field")
    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
            or str(column_type) == "string_view"):
        raise ConfigError(f'{name}: column "{field}" is {column_type}, not a string column')
    rows = reader.metadata.num_rows
    size, row, taken = Path(name).stat().st_size, 0, 0
    for batch in reader.iter_batches(batch_size=PARQUET_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise ConfigError(f'{name}: row {row}: "{field}" is null, not a string')
            share = size * row // rows - taken  # the file's bytes spread over its rows, for the progress bar
            taken += share
            yield text, share
