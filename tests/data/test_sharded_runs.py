"""`minitrain train --corpus` on sharded corpora: a store's corpus (moto's S3) trains and resumes mid-epoch bit for
bit, a mixture trains, and a shard altered before a resume stops the run with its name, the checkpoints untouched."""
import numpy as np

from tests.helpers.dist import run_cli
from tests.helpers.multinode import shards
from tests.helpers.s3_server import s3_server
from tests.helpers.shards import write_corpus

COMMON = ("--nproc", "2", "--model.seq_len", "16", "--batch-size", "4", "--train.log_every", "0", "--ckpt.every_steps", "3")
CORPUS = [700] * 6  # 43 windows a shard: the 6 steps below stop inside the first epoch's second block


def test_a_corpus_in_a_store_trains_and_resumes_mid_epoch_bit_for_bit(tmp_path):
    with s3_server("train-corpus") as fs:
        write_corpus("s3://train-corpus/notes", CORPUS, val=[300], fs=fs)
        corpus = ("--corpus", "s3://train-corpus/notes")
        whole = run_cli("train", *corpus, *COMMON, "--steps", "6", "--out", str(tmp_path / "whole"))
        assert whole.returncode == 0, whole.stderr
        half = run_cli("train", *corpus, *COMMON, "--steps", "6", "--stop-at", "3", "--out", str(tmp_path / "cut"))
        assert half.returncode == 0, half.stderr
        rest = run_cli("train", *corpus, *COMMON, "--steps", "6", "--resume", "auto", "--out", str(tmp_path / "cut"))
        assert rest.returncode == 0, rest.stderr
    assert shards(tmp_path / "cut", 6) == shards(tmp_path / "whole", 6)
    cached = list((tmp_path / "whole" / "data_cache").rglob("*.bin"))
    assert cached and all(p.stat().st_size == 1400 for p in cached)  # whole shards, fetched once, verified


def test_a_mixture_trains_and_a_shard_altered_before_a_resume_stops_it_with_the_name(tmp_path):
    write_corpus(tmp_path / "a", CORPUS, seed=1)
    write_corpus(tmp_path / "b", [500] * 3, seed=2)
    mixture = ("--corpus", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--data.weights", "0.7,0.3")
    out = tmp_path / "run"
    first = run_cli("train", *mixture, *COMMON, "--steps", "6", "--stop-at", "3", "--out", str(out))
    assert first.returncode == 0, first.stderr
    before = {p.relative_to(out): p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    for shard in (tmp_path / "a").glob("train-*.bin"):  # every shard: the first batch meets one
        tokens = np.fromfile(shard, dtype="<u2")
        tokens[0] ^= 1
        tokens.tofile(shard)
    again = run_cli("train", *mixture, *COMMON, "--steps", "6", "--resume", "auto", "--out", str(out))
    assert again.returncode == 2, again.stderr
    [line] = [ln for ln in again.stderr.splitlines() if "does not match its sha256" in ln]
    assert str(tmp_path / "a") in line and "train-0000" in line
    after = {p.relative_to(out): p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert after == before
