"""What the data tests share."""
from pathlib import Path

import pytest

from tests.helpers.prepared_corpus import notes_bpe


@pytest.fixture(scope="module")
def notes_tokenizer(tmp_path_factory) -> Path:
    """notes_bpe() as a tokenizer.json: --tokenizer spares the tests a BPE training each."""
    path = tmp_path_factory.mktemp("tokenizer") / "notes.json"
    notes_bpe().save(str(path))
    return path
