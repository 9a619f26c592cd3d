"""--train.offload: the optimizer's master weights and Adam state in host memory (cpu) or in memory-mapped files
(disk). Every mode trains bit for bit as without offload at every ZeRO stage, checkpoints move between modes,
disk offload's state is file pages (not the process's anonymous memory, as the OS counts it), its files go with
the run, and a directory it cannot write is refused before anything starts."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_cli, run_main, run_ranks
from tests.helpers.numerics import assert_bit_equal

pytestmark = pytest.mark.slow

STAGES = (0, 1, 2, 3)
MODES = ("none", "cpu", "disk")
STEPS = 4
# Full precision, and bf16 parameters beside a float32 master: there an offloaded master is published through a
# copy on the parameters' side (rounded) at every stage, chunk by chunk as the optimizer steps it.
DTYPES = {"float64": {"train.dtype": "float64"}, "float32": {"train.dtype": "float32"},
          "bf16": {"train.precision": "bf16"}}


def _config(world: int, zero: int, offload: str, out: str, **extra):
    from minitrain.train.run_config import run_config

    return run_config(cli_values={"train.zero": zero, "dist.nproc": world, "train.steps": 2 * STEPS,
                                  "train.log_every": 0, "train.offload": offload, "out": out, **extra})


def _state(trainer) -> dict:
    s = trainer.strategy
    return {"snapshot": s.state_snapshot(), "scalars": s.optimizer.scalar_state()}


def _every_mode(topo, out):
    from minitrain.train.trainer import Trainer

    got = {}
    for dtype in DTYPES:
        for zero in STAGES:
            for mode in MODES:
                root = f"{out}/{dtype}-{zero}-{mode}"
                with Trainer(_config(topo.world_size, zero, mode, root, **DTYPES[dtype]), topo) as trainer:
                    losses = [trainer.train_step().loss for _ in range(STEPS)]
                    files = sorted(p.name for p in Path(root, "offload").glob(f"rank-{topo.rank:05d}-*.bin"))
                    got[(dtype, zero, mode)] = {"losses": losses, "state": _state(trainer), "files": files,
                                                "params": trainer.strategy.full_params()}
                got[(dtype, zero, mode)]["left"] = sorted(p.name for p in Path(root, "offload").glob(f"rank-{topo.rank:05d}-*"))
    return got


def test_every_offload_mode_trains_bit_for_bit_as_without_at_every_stage(tmp_path):
    for rank, got in enumerate(run_ranks(_every_mode, 2, str(tmp_path))):
        for dtype in DTYPES:
            for zero in STAGES:
                plain = got[(dtype, zero, "none")]
                for mode in ("cpu", "disk"):
                    ours, where = got[(dtype, zero, mode)], f"rank {rank} {dtype} ZeRO-{zero} offload {mode}"
                    assert ours["losses"] == plain["losses"], where
                    assert torch.equal(ours["params"], plain["params"]), where
                    assert_bit_equal(ours["state"], plain["state"], where)
                disk = got[(dtype, zero, "disk")]
                assert disk["files"] == [f"rank-{rank:05d}-{name}.bin" for name in ("exp_avg", "exp_avg_sq", "master")]
                assert disk["left"] == [], f"{disk['left']} left after the run"


def _save_in_one_mode_resume_in_another(topo, out):
    from minitrain.train.trainer import Trainer

    results = {}
    for zero in (1, 3):
        for saved_with, resumed_with in (("disk", "none"), ("none", "disk"), ("cpu", "disk")):
            root = f"{out}/{zero}-{saved_with}-{resumed_with}"
            with Trainer(_config(topo.world_size, zero, saved_with, root), topo) as first:
                for _ in range(STEPS):
                    first.train_step()
                path = first.save_checkpoint(Path(root) / "checkpoints")
                straight = [first.train_step().loss for _ in range(STEPS)]
                end = first.strategy.full_params()
            with Trainer(_config(topo.world_size, zero, resumed_with, root), topo) as second:
                second.load_checkpoint(path)
                resumed = [second.train_step().loss for _ in range(STEPS)]
                results[(zero, saved_with, resumed_with)] = (straight == resumed,
                                                             torch.equal(end, second.strategy.full_params()))
    return results


def test_a_checkpoint_resumes_bit_identically_across_offload_modes(tmp_path):
    for results in run_ranks(_save_in_one_mode_resume_in_another, 2, str(tmp_path)):
        assert all(same_losses and same_params for same_losses, same_params in results.values()), results


def _save_sharded(topo, out):
    from minitrain.train.trainer import Trainer

    with Trainer(_config(topo.world_size, 2, "disk", out, **{"train.batch_size": 2}), topo) as trainer:
        for _ in range(STEPS):
            trainer.train_step()
        return str(trainer.save_checkpoint(Path(out) / "checkpoints")), trainer.strategy.full_params()


def _load_resharded(topo, out, path):
    from minitrain.train.trainer import Trainer

    got = {}
    for zero, mode in ((0, "none"), (1, "disk"), (3, "cpu")):
        cfg = _config(topo.world_size, zero, mode, f"{out}/{zero}-{mode}", **{"train.batch_size": 4})  # the same 4 a step
        with Trainer(cfg, topo) as trainer:
            trainer.load_checkpoint(path)
            loaded = trainer.strategy.full_params()
            state = {k: trainer.strategy.flat.to_logical(v) for k, v in trainer.strategy.optimizer.state_tensors().items()}
            got[mode] = {"loaded": loaded, "state": state, "losses": [trainer.train_step().loss for _ in range(STEPS)],
                         "end": trainer.strategy.full_params()}
    return got


def test_an_offloaded_checkpoint_reshards_into_any_layout_with_or_without_offload(tmp_path):
    # Saved by 2 ranks at ZeRO-2 with disk offload; loaded by 1 rank at ZeRO-0 without offload, ZeRO-1 with disk and
    # ZeRO-3 with cpu: every load holds the saved parameters and the same optimizer state, and trains alike.
    path, saved = run_ranks(_save_sharded, 2, str(tmp_path / "saved"))[0]
    got = run_ranks(_load_resharded, 1, str(tmp_path / "loaded"), path)[0]
    plain = got["none"]
    for mode in ("none", "disk", "cpu"):
        assert torch.equal(got[mode]["loaded"], saved), mode
        assert_bit_equal(got[mode]["state"], plain["state"], mode)
        assert got[mode]["losses"] == plain["losses"] and torch.equal(got[mode]["end"], plain["end"]), mode


def _rss_anon() -> int:
    """This process's anonymous resident bytes, after the C allocator has handed back the free memory it keeps: what
    it keeps depends on the order of earlier frees (glibc raises its mmap threshold as large blocks are freed, and
    later ones then come from a heap that may stay grown), and once left 12 MB more in one of two runs alike."""
    ctypes.CDLL(None).malloc_trim(0)
    return int(Path("/proc/self/status").read_text().split("RssAnon:")[1].split("kB")[0]) * 1024


def _anonymous_bytes(topo, out, offload):
    """What the trainer adds to the process's anonymous resident memory by the end of its second step."""
    from minitrain.train.trainer import Trainer

    cfg = _config(1, 0, offload, out, **{"model.preset": "small", "train.batch_size": 2})
    before = _rss_anon()  # the settings checked (disk offload's check builds the model on the meta device once)
    with Trainer(cfg, topo) as trainer:
        trainer.train_step()
        trainer.train_step()
        return _rss_anon() - before, trainer.strategy.optimizer.master.numel()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RssAnon is read from Linux's /proc")
def test_disk_offload_moves_the_optimizer_state_out_of_anonymous_memory(tmp_path):
    # Each mode in a fresh process (one rank), two steps of the small preset: master, m and v are 12 bytes per
    # parameter, 40 MB here; as file pages they leave the process's anonymous resident memory.
    none, params = run_ranks(_anonymous_bytes, 1, str(tmp_path / "none"), "none")[0]
    disk, _ = run_ranks(_anonymous_bytes, 1, str(tmp_path / "disk"), "disk")[0]
    state = 12 * params
    assert none - disk >= 0.8 * state, (none, disk, state)


def _offload_pages_resident() -> int:
    """Bytes of this process's offload files resident in its memory now (their mappings' Rss in /proc/self/smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line: address range ... path
            ours = "/offload/rank-" in line
        elif ours and first == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def _resident_while_stepping(topo, out):
    from minitrain.train.trainer import Trainer

    cfg = _config(1, 0, "disk", out, **{"model.preset": "small", "train.batch_size": 2,
                                         "train.offload_chunk_mb": 1})
    with Trainer(cfg, topo) as trainer:
        store, seen = trainer.offload, []
        release = store.release

        def noting(tensor=None):
            if tensor is not None:  # a chunk just stepped (the whole release comes after publishing the master)
                seen.append(_offload_pages_resident())
            release(tensor)

        store.release = noting
        for _ in range(2):
            trainer.train_step()
        return max(seen), len(seen), _offload_pages_resident(), trainer.strategy.optimizer.master.numel()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="resident pages are read from Linux's /proc")
def test_disk_offload_steps_one_chunk_at_a_time_and_keeps_no_state_resident(tmp_path):
    # --train.offload_chunk_mb 1: the optimizer steps 1 MiB of the master (and of m and v) at a time, and gives each
    # chunk's pages back once stepped, so no more than one chunk of each is ever resident; after the step (the master
    # published) none is. The files hold the state (the bit-for-bit test above).
    most, chunks, after, params = run_ranks(_resident_while_stepping, 1, str(tmp_path))[0]
    page, chunk = os.sysconf("SC_PAGE_SIZE"), 2**20
    assert chunks >= 2 * 3 * (4 * params // chunk), chunks  # two steps of master, m and v, chunk by chunk
    assert most <= 3 * (chunk + 2 * page), most
    assert after <= 3 * page, after


class AnonymousPeak:
    """The most RssAnon rose above its value at the start while the block ran, sampled by a thread every 0.5 ms
    (the OS's count; what a checkpoint holds lives for the whole write, many samples)."""

    def __enter__(self):
        self.base = self.peak = _rss_anon()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while self._running:
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()
        self.rise = max(self.peak, _rss_anon()) - self.base


def _checkpoint_memory(topo, out):
    from minitrain.train.trainer import Trainer

    got = {}
    for mode in ("none", "disk"):
        root = Path(out, mode)
        with Trainer(_config(1, 0, mode, str(root), **{"model.preset": "small", "train.batch_size": 1}), topo) as trainer:
            trainer.train_step()
            with AnonymousPeak() as save:
                path = trainer.save_checkpoint(root / "checkpoints")
            with AnonymousPeak() as background:
                trainer.start_async_save(root / "background").commit()
            with AnonymousPeak() as load:
                trainer.load_checkpoint(path)
            got[mode] = {"save": save.rise, "async save": background.rise, "load": load.rise,
                         "state": 12 * trainer.strategy.optimizer.master.numel()}
    return got


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RssAnon is read from Linux's /proc")
def test_checkpoints_of_disk_offloaded_state_never_hold_it_in_memory(tmp_path):
    # A save writes from the state's own files; a background save's copy and a load's reads go to files of their
    # own, a vector at a time: the process's anonymous memory does not grow by the state (40 MB here). Without
    # offload the background copy is in memory, which shows the measurement sees such a copy.
    got = run_ranks(_checkpoint_memory, 1, str(tmp_path))[0]
    state = got["disk"]["state"]
    assert got["none"]["async save"] >= 0.8 * state, got
    assert all(rise <= 0.15 * state for what, rise in got["disk"].items() if what != "state"), got


def test_an_offload_directory_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    proc = run_main("train", "--steps", "1", "--out", str(tmp_path / "run"), "--train.offload", "disk",
                    "--train.offload_dir", str(blocked / "offload"))
    assert proc.returncode == 2 and "--train.offload disk: cannot write" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def _hugging_face_through_prepare(topo, out):
    import minitrain

    from tests.helpers.hf_models import OPTIMIZERS, batches, lm_loss, make_model, param_groups

    minitrain.init_distributed(topology=topo)
    rank, world = minitrain.dp_rank(), minitrain.dp_world_size()
    got = {}
    for zero in STAGES:
        for mode in MODES:
            model = make_model("llama-tied")
            model, optimizer = minitrain.prepare(model, OPTIMIZERS["adamw"], zero=zero, param_groups=param_groups(model),
                                                 offload=mode, offload_dir=f"{out}/{zero}" if mode == "disk" else None)
            for x in batches(3, 4):
                lm_loss(model, x.chunk(world)[rank]).backward()
                minitrain.clip_grad_norm_(model, 1.0)
                optimizer.step()
                optimizer.zero_grad()
            files = sorted(p.name for p in Path(out, str(zero)).glob(f"rank-{topo.rank:05d}-*"))
            got[(zero, mode)] = {"state": optimizer.state_dict(), "model": minitrain.full_state_dict(model),
                                 "files": files}
    minitrain.cleanup()
    left = sorted(p.name for p in Path(out).rglob(f"rank-{topo.rank:05d}-*"))
    return got, left


def test_a_hugging_face_model_through_prepare_offloads_bit_for_bit(tmp_path):
    for rank, (got, left) in enumerate(run_ranks(_hugging_face_through_prepare, 2, str(tmp_path))):
        for zero in STAGES:
            for mode in ("cpu", "disk"):
                where = f"rank {rank} ZeRO-{zero} offload {mode}"
                assert_bit_equal(got[(zero, mode)]["state"], got[(zero, "none")]["state"], f"{where}: optimizer")
                assert_bit_equal(got[(zero, mode)]["model"], got[(zero, "none")]["model"], f"{where}: model")
            # Disk: the master and AdamW's two moments, in this rank's files while the session lasts.
            assert got[(zero, "disk")]["files"] == [f"rank-{rank:05d}-{name}.bin"
                                                    for name in ("exp_avg", "exp_avg_sq", "master")], zero
        assert left == [], left


def test_too_little_space_for_the_state_is_refused_before_the_run(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    import minitrain.train.offload_files as offload

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    proc = run_main("train", "--steps", "1", "--out", str(tmp_path / "run"), "--train.offload", "disk")
    assert proc.returncode == 2 and "the optimizer state needs" in proc.stderr and "are free there" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
    assert shutil.disk_usage is not None


def test_a_disk_that_fills_while_the_files_are_made_is_one_clear_error(tmp_path, monkeypatch):
    # Reserved when made (not sparse): a full disk is an error naming the file then, not SIGBUS at the first write
    # through the mapping, mid-step. What was made is removed.
    import errno

    from minitrain.parallel.core.offload import OffloadError, OffloadStore

    store = OffloadStore("disk", tmp_path, rank=0)
    store.zeros("exp_avg", 1000, torch.float32)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OffloadError, match=r"cannot reserve 8,000 bytes for .*rank-00000-exp_avg_sq.bin \(No space"):
        store.zeros("exp_avg_sq", 1000, torch.float64)
    assert list(tmp_path.iterdir()) == []


def test_files_a_crashed_run_left_are_made_afresh(tmp_path):
    # A run killed outright (the whole machine) leaves its files, maybe cut short or holding old state: the next run
    # on the directory (a resume, which takes the state from its checkpoint) makes each one anew, zeroed, full size.
    from minitrain.parallel.core.offload import OffloadStore

    (tmp_path / "rank-00000-master.bin").write_bytes(b"\x7f" * 10)
    (tmp_path / "rank-00000-exp_avg.bin").write_bytes(b"\x7f" * 100_000)
    store = OffloadStore("disk", tmp_path, rank=0)
    master, exp_avg = store.zeros("master", 1000, torch.float32), store.zeros("exp_avg", 1000, torch.float32)
    assert master.count_nonzero() == exp_avg.count_nonzero() == 0
    assert all(p.stat().st_size == 4000 for p in tmp_path.iterdir())
    store.check()
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_the_memory_profile_books_offloaded_state_off_the_device(tmp_path):
    # --memory-profile at ZeRO-2 with cpu offload: the optimizer row says it is in host memory and so does the
    # gradient shard's; the device's total leaves both out. The at-rest bytes still equal the formula.
    import json

    out = tmp_path / "run"
    proc = run_cli("train", "--nproc", "2", "--zero", "2", "--steps", "2", "--train.offload", "cpu",
                   "--memory-profile", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "memory.json").read_text())
    assert report["off_device"] == {"optimizer": "host", "grads": "host"}
    assert all(r["at_rest_equals_formula"] for r in report["ranks"])
    rank0 = report["ranks"][0]["at_rest"]
    lines = proc.stdout.splitlines()
    total = next(line for line in lines if "total on the device" in line)
    assert f" {rank0['params']} " in total, total
    assert any("optimizer (host)" in line for line in lines) and any("grads (host)" in line for line in lines)


def test_two_runs_given_one_offload_directory_write_apart(tmp_path):
    # A directory of each run's own under --train.offload_dir (named after OUT): one run never truncates another's
    # files. The default stays OUT/offload.
    from minitrain.train.offload_files import offload_directory

    shared = str(tmp_path / "nvme")
    first, second = (_config(1, 0, "disk", str(tmp_path / name), **{"train.offload_dir": shared}) for name in "ab")
    assert offload_directory(first) != offload_directory(second)
    assert offload_directory(first).parent == offload_directory(second).parent == tmp_path / "nvme"
    assert offload_directory(_config(1, 0, "disk", str(tmp_path / "c"))) == tmp_path / "c" / "offload"


def test_a_gpus_master_crosses_into_a_kept_buffer_and_rounds_as_one_copy_would():
    """What a GPU's publishing of an offloaded master does, on this CPU: the master crosses into a staging buffer
    and is rounded after (copy_through, any length against any buffer), the same bits as one converting copy."""
    from minitrain.parallel.core.offload import copy_through

    torch.manual_seed(0)
    master = torch.randn(1000) * 10
    for stage_len in (7, 1000, 4096):
        published = copy_through(torch.empty(1000, dtype=torch.bfloat16), master, torch.empty(stage_len))
        assert torch.equal(published, master.to(torch.bfloat16)), stage_len


class _CopiesAsAStreamRunsThem:
    """offload.CopyStream as a GPU's stream runs an offloaded step's copies, on this CPU: every chunk crosses (as
    if the gradient and the parameters were on a GPU and the master on the host), and each copy runs either as
    it is issued or only once the host waits for its mark or a later one (one stream: in order)."""

    def __init__(self, runs_when: str):
        self.runs_when, self.issued, self.ran = runs_when, [], 0

    def crosses(self, tensor, device) -> bool:
        return True

    def issue(self, copy, device) -> int:
        self.issued.append(copy)
        if self.runs_when == "issued":
            self.wait(len(self.issued))
        return len(self.issued)

    def wait(self, mark) -> None:
        while mark is not None and self.ran < mark:
            self.issued[self.ran]()
            self.ran += 1


@pytest.mark.parametrize("runs_when", ["issued", "waited for"])
def test_an_offloaded_step_copies_ahead_and_reads_no_chunk_before_it_lands(runs_when):
    """A GPU's offloaded step issues its copies without waiting: each gradient chunk to the host one chunk ahead
    of the one the host steps (two pinned buffers kept for the run, by turns), each stepped chunk of the master
    back to the parameters, through a device buffer and rounded there. Copies that land at once, or only when
    waited for, give the bits of plain copies: no chunk is read before it lands, none is overwritten before it is
    stepped, and every one has landed when the step returns."""
    from minitrain.train.optim import FlatAdamW

    torch.manual_seed(0)
    n, chunk = 1000, 128  # 8 chunks, the last one short
    for dtype in (torch.bfloat16, torch.float32):
        master = torch.randn(n) * 10
        plain = FlatAdamW(master.clone(), [(0, 600)], chunk=chunk)
        copies = _CopiesAsAStreamRunsThem(runs_when)
        ours = FlatAdamW(master.clone(), [(0, 600)], chunk=chunk, copies=copies)
        params = torch.full((n,), float("nan"), dtype=dtype)
        for step in range(3):
            grad = torch.randn(n).to(dtype)
            plain.step(grad.clone(), 1e-2, grad_scale=0.5)
            ours.step(grad.clone(), 1e-2, grad_scale=0.5, publish_to=params)
            where = f"{dtype}, step {step}"
            assert torch.equal(params, plain.master.to(dtype)), where
            assert all(torch.equal(ours.state_tensors()[k], v) for k, v in plain.state_tensors().items()), where
            if step == 0:
                kept = [t.data_ptr() for t in ours._landing]
        assert [t.data_ptr() for t in ours._landing] == kept and len(set(kept)) == 2, "two buffers, kept"
        assert len(copies.issued) == 3 * 2 * 8, "each chunk crossed both ways"
