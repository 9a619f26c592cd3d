"""`minitrain train --corpus` on sharded corpora: a store's corpus (moto's S3) trains and resumes mid-epoch bit for
bit, through an outage of the store too, a mixture trains, and a shard altered before a resume stops the run with its name, the checkpoints untouched."""
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from tests.helpers.cable import Cable
from tests.helpers.dist import DEFAULT_TIMEOUT_S, run_cli
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


def test_a_store_down_in_the_middle_of_a_run_is_waited_for_and_the_run_ends_as_the_uninterrupted_one(tmp_path):
    """The link to the S3 server is cut after step 2 and restored once a rank says it is waiting: the run goes on
    and ends with the parameters of a run that met no outage. Shards of 10 windows in blocks of 4: a block lasts 5
    steps, so the run fetches blocks all along and one of them meets the outage."""
    # Rank 0 sleeps 0.3 s a step (the numbers are those of a fast run): the outage begins before the next fetch.
    args = ("train", "--corpus", "s3://outage/c", *COMMON, "--steps", "14", "--train.log_every", "1",
            "--fault.kind", "slow", "--fault.step", "1", "--fault.slow_s", "0.3")
    with s3_server("outage") as fs:
        write_corpus("s3://outage/c", [161] * 24, val=[100], fs=fs)
        clean = run_cli(*args, "--out", str(tmp_path / "clean"))
        assert clean.returncode == 0, clean.stderr
        link = Cable(int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
        env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{link.port}"}
        proc = subprocess.Popen([sys.executable, "-m", "minitrain", *args, "--out", str(tmp_path / "outage")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env=env)
        lines = Lines(proc)
        try:
            lines.wait_for(lambda line: line.startswith("step  2/"))
            link.cut()
            waiting = lines.wait_for(lambda line: "waiting for s3://outage/c/train-" in line)
            link.restore()
            assert proc.wait(timeout=DEFAULT_TIMEOUT_S) == 0, "\n".join(lines.seen[-20:])
        finally:
            lines.kill()
            link.cut()
    assert "retrying for up to 240 s" in waiting
    assert shards(tmp_path / "outage", 14) == shards(tmp_path / "clean", 14)


class Lines:
    """Every line a process writes (stdout and stderr), read as it comes, and a wait for one of them; a hard
    timeout kills the process group."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.seen, self.cond = proc, [], threading.Condition()
        for stream in (proc.stdout, proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self.cond:
                self.seen.append(line.rstrip("\n"))
                self.cond.notify_all()

    def wait_for(self, predicate, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
        with self.cond:
            if not self.cond.wait_for(lambda: any(predicate(line) for line in self.seen) or self.proc.poll() is not None,
                                      timeout=timeout_s):
                self.kill()
                pytest.fail(f"no such line within {timeout_s} s: " + "\n".join(self.seen[-20:]))
            found = [line for line in self.seen if predicate(line)]
            if not found:
                pytest.fail("the run ended first: " + "\n".join(self.seen[-20:]))
            return found[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
