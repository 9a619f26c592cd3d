"""Checkpoints on object storage, against a real S3-compatible server (moto's, in a thread on a free port, started
here: no network, nobody's credentials): a run that loses its disk resumes from the store bit-identically; what
the store holds; tampered objects refused; transient failures retried, then named; two runs under different
prefixes of one bucket kept apart; a re-save of a step; bad locations refused at startup."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from minitrain import checkpoint
from minitrain.checkpoint import remote

from tests.helpers.dist import run_cli, run_main
from tests.helpers.cable import Cable
from tests.helpers.s3_server import s3_server

pytestmark = pytest.mark.slow

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'minitrain[s3]')")
moto_server = pytest.importorskip("moto.server", reason="moto is not installed (the test extra installs it)")

BUCKET = "minitrain-test"
TINY = ("--preset", "tiny", "--steps", "6", "--train.log_every", "0")


@pytest.fixture(scope="module")
def s3():
    with s3_server(BUCKET) as fs:
        yield fs


def _train(out: Path, *extra: str) -> dict:
    """`minitrain train` from this process (its ranks forked as the command forks them, without an interpreter's
    start-up); returns the run's summary.json."""
    (out / "summary.json").unlink(missing_ok=True)
    result = run_main("train", *TINY, "--out", str(out), *extra)
    assert result.returncode == 0, result.stderr
    return json.loads((out / "summary.json").read_text())


def _final_tensors(out: Path) -> dict[str, torch.Tensor]:
    step_dir = checkpoint.resolve(out)
    from safetensors.torch import load_file

    return {f"{f.name}:{k}": v for f in sorted(step_dir.glob("rank-*.safetensors"))
            for k, v in load_file(str(f)).items()}


@pytest.mark.multirank
def test_a_run_that_loses_its_disk_resumes_from_the_store_bit_identically(s3, tmp_path):
    url = f"s3://{BUCKET}/lost-disk"
    two_ranks = ("--nproc", "2", "--zero", "2")  # each rank uploads its share
    _train(tmp_path / "reference", *two_ranks)  # six steps, no store
    out = tmp_path / "run"
    _train(out, *two_ranks, "--ckpt.dir", url, "--ckpt-every-steps", "3", "--stop-at", "3")
    assert remote.committed_steps(url) == [3]
    shutil.rmtree(out)  # the node, its disk and everything on it are gone; the store is not
    resumed = _train(out, *two_ranks, "--ckpt.dir", url, "--ckpt-every-steps", "3", "--resume", "auto")
    assert resumed["resumed_from"].endswith("step-000003")
    assert remote.committed_steps(url) == [6, 3]
    mine, reference = _final_tensors(out), _final_tensors(tmp_path / "reference")
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)
    assert len(remote.read_commit(url, 3)["files"]) == 4  # a shard per rank, the manifest and its sha256
    # What the store holds: each step's commit and the files it names, under the manifest's prefix; nothing else.
    for step in (3, 6):
        commit = remote.read_commit(url, step)
        assert commit["prefix"].startswith(f"step-{step:06d}/")
        listed = {p.rsplit("/", 1)[-1]: s3.size(p) for p in s3.ls(f"{BUCKET}/lost-disk/{commit['prefix']}")}
        assert listed == commit["files"]
    assert {p.rsplit("/", 1)[-1] for p in s3.ls(f"{BUCKET}/lost-disk")} == {
        "step-000003", "step-000003.json", "step-000006", "step-000006.json", "latest.json"}
    assert remote.latest_step(url) == 6


def _committed(s3, tmp_path, url: str) -> Path:
    """A checkpoint of a 2-step tiny run, committed under url; returns the run's OUT."""
    out = tmp_path / "saved"
    _train(out, "--steps", "2", "--ckpt.dir", url)
    return out


@pytest.mark.multirank
def test_tampered_objects_are_refused_naming_them(s3, tmp_path):
    url = f"s3://{BUCKET}/tampered"
    _committed(s3, tmp_path, url)
    commit = remote.read_commit(url, 2)
    shard = f"{BUCKET}/tampered/{commit['prefix']}/rank-00000.safetensors"
    data = bytearray(s3.cat_file(shard))
    data[-1] ^= 0xFF  # one flipped bit in the last tensor's bytes: same size, other content
    s3.pipe_file(shard, bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="rank-00000.safetensors is corrupt"):
        remote.fetch(url, 2, tmp_path / "elsewhere")
    assert not list((tmp_path / "elsewhere").iterdir())  # nothing half-fetched left behind
    manifest = f"{BUCKET}/tampered/{commit['prefix']}/manifest.json"
    s3.pipe_file(manifest, s3.cat_file(manifest).replace(b'"step": 2', b'"step": 3', 1))  # same size, other step
    with pytest.raises(checkpoint.CheckpointError, match="is not the manifest its commit names"):
        remote.fetch(url, 2, tmp_path / "elsewhere")


@pytest.mark.multirank
def test_transient_failures_are_retried_then_fail_naming_the_object(s3, tmp_path, monkeypatch):
    url = f"s3://{BUCKET}/flaky"
    out = _committed(s3, tmp_path, url)
    step_dir = checkpoint.resolve(out)
    monkeypatch.setattr(remote.client, "FIRST_BACKOFF_S", 0.01)
    real_put, failures = s3.put_file, []

    def flaky(*args, **kwargs):  # the connection drops twice, then the upload goes through
        if len(failures) < 2:
            failures.append(1)
            raise ConnectionResetError("connection reset by peer")
        return real_put(*args, **kwargs)

    monkeypatch.setattr(s3, "put_file", flaky)
    remote.upload_files(step_dir, f"s3://{BUCKET}/flaky-again", ["rank-00000.safetensors"])
    assert len(failures) == 2 and s3.exists(f"{BUCKET}/flaky-again/{remote.commits.object_prefix(step_dir)}/rank-00000.safetensors")

    def down(*args, **kwargs):
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(s3, "put_file", down)
    with pytest.raises(checkpoint.CheckpointError, match=r"uploading s3://.*/rank-00000.safetensors failed 5 times"):
        remote.upload_files(step_dir, url, ["rank-00000.safetensors"])
    assert remote.committed_steps(url) == [2]  # the committed checkpoint is as it was, and loads
    monkeypatch.setattr(s3, "put_file", real_put)
    assert checkpoint.verify(remote.fetch(url, 2, tmp_path / "again"))[1]["step"] == 2


def _latest_named(url: str) -> int | None:
    """The step URL/latest.json names, None before it is written."""
    fs, root = remote.store(url)
    try:
        return json.loads(fs.cat_file(f"{root}/{remote.LATEST_NAME}"))["step"]
    except FileNotFoundError:
        return None


def test_a_store_that_goes_away_mid_run_stops_it_naming_the_object_and_keeps_what_was_committed(s3, tmp_path):
    url = f"s3://{BUCKET}/goes-away"
    cable = Cable(int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{cable.port}"}
    argv = ["train", *TINY, "--out", str(tmp_path / "run"), "--ckpt.dir", url, "--ckpt-every-steps", "2", "--steps",
            "4", "--fault.kind", "slow", "--fault.step", "3", "--fault.slow_s", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "minitrain", *argv], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        # Step 2 is in the store and its commit is over (latest.json, its last write, names it): now the network goes.
        while remote.committed_steps(url) != [2] or _latest_named(url) != 2:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        cable.down = True
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode != 0, err
    assert "uploading step-000004" in err and "goes-away/step-000004" in err and "failed 5 times" in err, err
    assert remote.committed_steps(url) == [2]
    assert checkpoint.verify(remote.fetch(url, 2, tmp_path / "fetched"))[1]["step"] == 2


@pytest.mark.multirank
def test_two_runs_under_different_prefixes_of_one_bucket_are_kept_apart(s3, tmp_path):
    a, b = f"s3://{BUCKET}/team/a", f"s3://{BUCKET}/team/b"
    _train(tmp_path / "a", "--steps", "2", "--ckpt.dir", a)
    _train(tmp_path / "b", "--steps", "3", "--ckpt.dir", b)
    assert remote.committed_steps(a) == [2] and remote.committed_steps(b) == [3]
    assert remote.newest_locally(a, tmp_path / "fresh").name == "step-000002"


@pytest.mark.multirank
def test_a_save_of_the_same_step_again(s3, tmp_path):
    url = f"s3://{BUCKET}/again"
    out = _committed(s3, tmp_path, url)
    step_dir = checkpoint.resolve(out)
    first = remote.read_commit(url, 2)
    assert remote.commit_upload(step_dir, url) == first  # a retried save: the committed one stays
    # Another checkpoint of step 2 (a line resumed from an older step): replaces it, its old objects deleted.
    other = tmp_path / "other"
    _train(other, "--steps", "2", "--seed", "7")
    other_dir = checkpoint.resolve(other)
    names = sorted(p.name for p in other_dir.iterdir())
    remote.upload_files(other_dir, url, names)
    second = remote.commit_upload(other_dir, url)
    assert second["prefix"] != first["prefix"] and remote.read_commit(url, 2) == second
    assert not s3.exists(f"{BUCKET}/again/{first['prefix']}")


@pytest.mark.multirank
def test_keep_last_deletes_old_checkpoints_from_the_store_too(s3, tmp_path):
    url = f"s3://{BUCKET}/keep"
    _train(tmp_path / "run", "--ckpt.dir", url, "--ckpt-every-steps", "2", "--ckpt.keep_last", "2")
    assert remote.committed_steps(url) == [6, 4]
    assert {p.rsplit("/", 1)[-1] for p in s3.ls(f"{BUCKET}/keep")} == {
        "step-000004", "step-000004.json", "step-000006", "step-000006.json", "latest.json"}


@pytest.mark.parametrize("url,message", [
    ("hdfs://namenode:9000/runs", "--ckpt.dir hdfs://namenode:9000/runs"),
    ("nosuchscheme://x/y", "--ckpt.dir nosuchscheme://x/y"),
    ("relative/store", "give an absolute path"),
    ("{out}/store", "overlap"),
    ("/proc/no-store-here", "cannot use it"),
])
def test_a_location_that_cannot_be_used_is_refused_before_the_run(tmp_path, url, message):
    result = run_main("train", *TINY, "--out", str(tmp_path / "r"), "--ckpt.dir", url.format(out=tmp_path / "r"))
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()  # nothing half-written


@pytest.mark.multirank
def test_the_checkpoint_tools_and_export_read_the_store(s3, tmp_path):
    url = f"s3://{BUCKET}/tools"
    out = tmp_path / "run"
    _train(out, "--ckpt.dir", url, "--ckpt-every-steps", "3")
    listed = run_main("ckpt", "list", url)
    assert listed.returncode == 0 and "2 complete checkpoint(s)" in listed.stdout, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()[3:]] == ["6", "3"]
    verified = run_main("ckpt", "verify", f"{url}/step-000003")
    assert verified.returncode == 0 and verified.stdout.startswith("OK: ") and "step-000003" in verified.stdout
    merged = run_main("ckpt", "consolidate", url, str(tmp_path / "model.safetensors"))
    assert merged.returncode == 0, merged.stderr
    local = run_main("ckpt", "consolidate", str(out), str(tmp_path / "local.safetensors"))
    assert local.returncode == 0 and (tmp_path / "model.safetensors").read_bytes() == \
        (tmp_path / "local.safetensors").read_bytes()
    exported = run_main("export", url, str(tmp_path / "export"))
    assert exported.returncode == 0 and url in exported.stdout, exported.stderr
    assert json.loads((tmp_path / "export" / "config.json").read_text())["source"] == url
    missing = run_main("ckpt", "verify", f"{url}/step-000009")
    assert missing.returncode == 1 and "no committed checkpoint of step 9" in missing.stderr
    assert not list(Path(tempfile.gettempdir()).glob("minitrain-fetch-*"))  # the fetched copies are gone


def test_the_api_saves_to_and_loads_from_the_store(s3, tmp_path):
    from tests.helpers.store_round_trip import round_trip

    url = f"s3://{BUCKET}/api"
    assert round_trip(url, zero=1) == (f"{url}/step-000002", (2, {"epoch": 1}), True)
    assert remote.committed_steps(url) == [2]
    assert not list(Path(tempfile.gettempdir()).glob("minitrain-staging-*"))  # the local copies are gone


def test_the_api_round_trip_through_the_store_on_two_ranks(s3):
    url = f"s3://{BUCKET}/api-two"
    script = Path(__file__).resolve().parents[1] / "helpers" / "store_round_trip.py"
    result = run_cli(str(script), url, script=True, torchrun_nproc=2, timeout_s=120)
    assert result.returncode == 0 and "same after the round trip" in result.stdout, result.stderr[-3000:]
    assert remote.committed_steps(url) == [2] and len(remote.read_commit(url, 2)["files"]) == 4


def test_a_run_killed_mid_upload_loses_nothing_committed_and_its_leftovers_are_swept(s3, tmp_path):
    url = f"s3://{BUCKET}/killed"
    cable = Cable(int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{cable.port}"}
    out = tmp_path / "run"
    # Steps 3 and 4 take a second each: time to slow the cable once step 2 is committed, whatever the machine's load.
    argv = ["train", *TINY, "--out", str(out), "--ckpt.dir", url, "--ckpt-every-steps", "2", "--steps", "4",
            "--nproc", "2", "--fault.kind", "slow", "--fault.step", "3", "--fault.slow_s", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "minitrain", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while remote.committed_steps(url) != [2]:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        cable.slow = 0.5  # step 4's upload crawls ...
        while not s3.glob(f"{BUCKET}/killed/step-000004/*/*"):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, 9)  # ... and the whole run dies in the middle of it
        proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert remote.committed_steps(url) == [2]  # step 4 was never committed; step 2 is whole
    assert s3.glob(f"{BUCKET}/killed/step-000004/*/*")  # what it left behind
    shutil.rmtree(out)
    cable.slow = 0.0
    resumed = run_cli("train", *TINY, "--out", str(out), "--ckpt.dir", url, "--ckpt-every-steps", "2", "--steps",
                      "4", "--nproc", "2", "--resume", "auto", env={"AWS_ENDPOINT_URL": env["AWS_ENDPOINT_URL"]},
                      timeout_s=120)
    assert resumed.returncode == 0 and "step-000002" in resumed.stdout, resumed.stderr
    assert remote.committed_steps(url) == [4, 2]
    commit = remote.read_commit(url, 4)
    # The leftovers of the killed upload are gone: step 4 holds only what its commit names.
    assert {p.rsplit("/", 1)[-1] for p in s3.glob(f"{BUCKET}/killed/step-000004/*/*")} == set(commit["files"])


@pytest.mark.multirank
def test_keep_last_in_the_store_follows_the_run_s_line_as_the_local_one_does(s3, tmp_path):
    # A run to step 8 (the store keeps 6 and 8), then resumed from step 6 with another learning rate and stopped at
    # 7: the store's current line is 6-7; step 8 belongs to the abandoned one. Losing the disk must lead back to 7.
    url = f"s3://{BUCKET}/lines"
    out = tmp_path / "run"
    common = ("--steps", "8", "--ckpt.dir", url, "--ckpt-every-steps", "2")
    _train(out, *common, "--ckpt.keep_last", "2")
    assert remote.committed_steps(url) == [8, 6]
    _train(out, *common, "--ckpt.keep_last", "1", "--resume", str(out / "checkpoints" / "step-000006"),
           "--lr", "0.0005", "--stop-at", "7")
    assert remote.latest_step(url) == 7 and remote.committed_steps(url) == [7]  # 8 gone with its line
    shutil.rmtree(out)
    resumed = _train(out, *common, "--resume", "auto", "--lr", "0.0005")
    assert resumed["resumed_from"].endswith("step-000007")


@pytest.mark.multirank
def test_resume_auto_takes_the_run_s_current_checkpoint_not_the_highest_step(s3, tmp_path):
    url = f"s3://{BUCKET}/current"
    out = tmp_path / "run"
    _train(out, "--ckpt.dir", url, "--ckpt-every-steps", "2")  # steps 2, 4, 6 in the store
    _train(out, "--ckpt.dir", url, "--ckpt-every-steps", "2", "--resume", str(out / "checkpoints" / "step-000002"),
           "--stop-at", "3")  # a new line from step 2, stopped at 3: the run's current checkpoint
    assert remote.latest_step(url) == 3 and 6 in remote.committed_steps(url)
    resumed = _train(out, "--ckpt.dir", url, "--ckpt-every-steps", "2", "--resume", "auto")
    assert resumed["resumed_from"].endswith("step-000003") and resumed["steps"] == 6  # not "already finished"
    # A local line the store never saw (the store stale behind it): kept, not replaced by the store's older one.
    local = tmp_path / "local"
    _train(local, "--steps", "4", "--ckpt.dir", f"s3://{BUCKET}/stale", "--ckpt-every-steps", "2")
    mine = checkpoint.resolve(local / "checkpoints" / "step-000002")
    _train(local, "--steps", "4", "--ckpt-every-steps", "2", "--resume", str(mine), "--lr", "0.0001")
    before = (local / "checkpoints" / "step-000004" / "manifest.json").read_bytes()
    assert remote.newest_locally(f"s3://{BUCKET}/stale", local / "checkpoints") is None
    assert (local / "checkpoints" / "step-000004" / "manifest.json").read_bytes() == before


@pytest.mark.multirank
def test_a_failed_replacement_of_a_commit_leaves_the_old_one(s3, tmp_path, monkeypatch):
    url = f"s3://{BUCKET}/replace"
    _committed(s3, tmp_path, url)
    first = remote.read_commit(url, 2)
    other = tmp_path / "other"
    _train(other, "--steps", "2", "--seed", "7")
    other_dir = checkpoint.resolve(other)
    remote.upload_files(other_dir, url, sorted(p.name for p in other_dir.iterdir()))
    monkeypatch.setattr(remote.client, "FIRST_BACKOFF_S", 0.01)

    def refused(*args, **kwargs):
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(s3, "pipe_file", refused)
    with pytest.raises(checkpoint.CheckpointError, match="committing"):
        remote.commit_upload(other_dir, url)
    assert remote.read_commit(url, 2) == first and s3.exists(f"{BUCKET}/replace/{first['prefix']}/manifest.json")


@pytest.mark.multirank
def test_a_damaged_local_copy_is_fetched_again_not_returned(s3, tmp_path):
    url = f"s3://{BUCKET}/damaged"
    _committed(s3, tmp_path, url)
    fetched = remote.fetch(url, 2, tmp_path / "copy")
    shard = fetched / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    again = remote.fetch(url, 2, tmp_path / "copy")
    assert checkpoint.verify(again)[1]["step"] == 2


@pytest.mark.multirank
def test_the_ranks_of_a_machine_fetch_the_store_s_checkpoint_once_between_them(s3, tmp_path, monkeypatch):
    # Under torchrun every rank resolves --resume auto itself: four at once into one OUT/checkpoints. Each fetch
    # is slowed so that, unserialized, all four would fetch and race to write `latest`.
    from concurrent.futures import ThreadPoolExecutor

    url = f"s3://{BUCKET}/together"
    _committed(s3, tmp_path, url)
    fetches, real_fetch = [], remote.transfer.fetch

    def slow_fetch(*args):
        fetches.append(args)
        time.sleep(0.5)
        return real_fetch(*args)

    monkeypatch.setattr(remote.transfer, "fetch", slow_fetch)
    local = tmp_path / "machine" / "checkpoints"
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda _: remote.newest_locally(url, local), range(4)))
    assert len(fetches) == 1 and sum(path is not None for path in found) == 1, (fetches, found)
    assert (local / "latest").read_text().strip() == "step-000002"
    assert checkpoint.find_latest(local.parent).name == "step-000002"


def _train_on_own_disks(topo, root: str, url: str, *extra: str) -> dict:
    """One rank of a cluster whose machines share no OUT: each rank trains with an OUT of its own."""
    from minitrain.apps.cli import build_parser, resolve_config
    from minitrain.config import ConfigError
    from minitrain.train.loop import train_worker

    out = Path(root) / f"machine-{topo.rank}"
    store = ("--ckpt.dir", url) if url else ()
    cfg = resolve_config(build_parser().parse_args(["train", *TINY, "--nproc", "2", "--zero", "2", "--out", str(out),
                                                    *store, *extra]))
    out.mkdir(parents=True, exist_ok=True)
    try:
        summary = train_worker(topo, cfg)
    except ConfigError as e:
        return {"error": str(e)}
    return {"shards_left": sorted(p.parent.name + "/" + p.name for p in out.rglob("rank-*.safetensors")),
            "rolled_back_to": [event["to_step"] for event in summary["rollbacks"]], "saved": summary["checkpoints"]}


@pytest.mark.parametrize("where", ["s3", "a shared filesystem"])
def test_machines_without_a_shared_out_assemble_each_checkpoint_in_the_store(s3, tmp_path, where):
    # Each machine its own disk: a machine's checkpoint directory holds its own ranks' files; each rank uploads its
    # own, rank 0 the manifest, and the checkpoint is whole in the store only. Both disks lost, the run resumes from
    # there on every machine, bit-identical to a run on one shared OUT. The store: a bucket, or a directory every
    # machine mounts (NFS), written as safely as OUT (checkpoint/local_store.py).
    from tests.helpers.dist import run_ranks

    url = f"s3://{BUCKET}/own-disks" if where == "s3" else str(tmp_path / "nfs" / "checkpoints")
    _train(tmp_path / "reference", "--nproc", "2", "--zero", "2")
    machines = str(tmp_path / "machines")
    stopped = run_ranks(_train_on_own_disks, 2, machines, url, "--ckpt-every-steps", "3", "--stop-at", "3")
    # A machine's share resumes nothing: removed once committed; the run names the store's copy.
    assert stopped == [{"shards_left": [], "rolled_back_to": [], "saved": [f"{url}/step-000003"]}] * 2
    assert remote.committed_steps(url) == [3] and len(remote.read_commit(url, 3)["files"]) == 4
    shutil.rmtree(machines)
    # Step 3 fetched for the resume, then pruned by keep_last 1 when step 6 was saved; step 6's share removed.
    assert run_ranks(_train_on_own_disks, 2, machines, url, "--ckpt-every-steps", "3", "--resume", "auto",
                     "--ckpt.keep_last", "1") == [{"shards_left": [], "rolled_back_to": [],
                                                   "saved": [f"{url}/step-000006"]}] * 2
    assert remote.committed_steps(url) == [6]  # keep_last 1 in the store too
    fetched = remote.fetch(url, 6, tmp_path / "fetched")
    mine, reference = _final_tensors(fetched), _final_tensors(tmp_path / "reference")
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)
    # Without a store such a run could save nothing whole: refused before its first step, on every rank.
    refused = run_ranks(_train_on_own_disks, 2, str(tmp_path / "nostore"), "")
    assert all("is not one directory for every rank" in r["error"] and "--ckpt.dir" in r["error"] for r in refused)


def test_a_loss_spike_on_machines_without_a_shared_out_rolls_back_to_the_store_s_checkpoint(s3, tmp_path):
    # No machine keeps a whole checkpoint: the rollback target is the store's, fetched onto every machine.
    from tests.helpers.dist import run_ranks

    spike = ("--steps", "16", "--ckpt-every-steps", "5", "--fault.kind", "lr-spike", "--fault.step", "12",
             "--fault.lr_multiplier", "1000")
    _train(tmp_path / "shared", "--nproc", "2", "--zero", "2", *spike)
    machines = str(tmp_path / "machines")
    [first, _] = run_ranks(_train_on_own_disks, 2, machines, f"s3://{BUCKET}/spike", *spike)
    assert first["rolled_back_to"] == [10]
    mine = _final_tensors(remote.fetch(f"s3://{BUCKET}/spike", 16, tmp_path / "fetched"))
    reference = _final_tensors(tmp_path / "shared")
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)


def test_a_background_save_uploads_in_the_background(s3, tmp_path, monkeypatch):
    # With --ckpt.async_save the upload runs in a thread too: the run goes on while it is in flight, and commits it
    # in the store once every rank's share is up (the steps' exchange agrees on it); nothing is lost at the end.
    from minitrain.train.loop import TrainingRun
    from minitrain.train.run_config import run_config
    from minitrain.runtime.topology import Topology

    url = f"s3://{BUCKET}/background"
    upload, commit = remote.upload_files, remote.commit_upload
    committed_at, uploading = {}, {}
    # No sleeps (a loaded machine reorders them). A save's background write finishes before the next step starts, so
    # its upload begins at that step's boundary; the upload then waits until a later step has finished. Were it
    # synchronous it would hold training still: its wait would run out and it would end at the step it began at.

    def slow_upload(step_dir, *args):
        step, began = checkpoint.step_of(step_dir), run.trainer.step
        deadline = time.monotonic() + 30
        while step < 15 and run.trainer.step == began and time.monotonic() < deadline:
            time.sleep(0.01)  # a slow store, still uploading while training goes on
        upload(step_dir, *args)
        uploading[step] = (began, run.trainer.step)

    def launch_once_written(requests):
        write = requests.pending_save
        if write is not None and not isinstance(write, remote.Upload):
            deadline = time.monotonic() + 30
            while not write.written and time.monotonic() < deadline:
                time.sleep(0.01)
        return run_launch_step(requests)

    def record_commit(step_dir, *args):
        committed_at[checkpoint.step_of(step_dir)] = run.trainer.step
        return commit(step_dir, *args)

    monkeypatch.setattr(remote.transfer, "upload_files", slow_upload)
    monkeypatch.setattr(remote.transfer, "commit_upload", record_commit)
    values = {"model.preset": "tiny", "train.steps": 15, "train.log_every": 0, "ckpt.every_steps": 5,
              "ckpt.async_save": True, "ckpt.dir": url, "out": str(tmp_path / "run")}
    run = TrainingRun(Topology.single(), run_config(cli_values=values))
    run_launch_step = run.trainer.launch_step
    monkeypatch.setattr(run.trainer, "launch_step", launch_once_written)
    run.run()
    assert sorted(committed_at) == [5, 10, 15] and remote.committed_steps(url) == [15, 10, 5]
    # Training went on while each was uploading (the next save waits for it), and committed it after.
    assert all(uploading[step][0] < uploading[step][1] <= step + 5 for step in (5, 10)), uploading
    assert all(committed_at[step] > step for step in (5, 10))
    assert committed_at[15] == 15  # the last one before the run ends
    monkeypatch.undo()
    fetched = _final_tensors(remote.fetch(url, 15, tmp_path / "fetched"))
    local = _final_tensors(tmp_path / "run")
    assert fetched.keys() == local.keys() and all(torch.equal(fetched[k], local[k]) for k in fetched)


def test_a_store_on_a_shared_filesystem_writes_whole_files_or_none(tmp_path, monkeypatch):
    # What a crash or a refusal in the middle of a write leaves: the old file or the new one, never half of one, and
    # no temporary behind; a commit object is created only once.
    from minitrain.checkpoint import local_store

    fs, root = remote.store(f"file://{tmp_path}/store")
    fs.pipe_file(f"{root}/latest.json", b'{"step": 3}')
    fs.create_only(f"{root}/step-000003.json", b"first")
    with pytest.raises(FileExistsError):
        fs.create_only(f"{root}/step-000003.json", b"second")

    def power_cut(*_args):
        raise OSError("power cut")

    monkeypatch.setattr(local_store.os, "replace", power_cut)
    source = tmp_path / "rank-00000.safetensors"
    source.write_bytes(b"x" * 100)
    for write in (lambda: fs.pipe_file(f"{root}/latest.json", b'{"step": 6}'),
                  lambda: fs.put_file(source, f"{root}/step-000006/abc/rank-00000.safetensors")):
        with pytest.raises(OSError, match="power cut"):
            write()
    assert (tmp_path / "store" / "latest.json").read_bytes() == b'{"step": 3}'
    assert (tmp_path / "store" / "step-000003.json").read_bytes() == b"first"
    assert not (tmp_path / "store" / "step-000006" / "abc" / "rank-00000.safetensors").exists()
    assert not [p for p in (tmp_path / "store").rglob("*.part")]
