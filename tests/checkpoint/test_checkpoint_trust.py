"""A checkpoint is used only once everything in it checks out: the manifest's fields (and its own sha256),
where its files are, and each shard's header against the manifest. Each test is an attack that once
worked; each must now end in a CheckpointError naming the file and the field (exit 2, one line, through
`minitrain train --resume`), with nothing written."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from minitrain import checkpoint
from minitrain.checkpoint import CheckpointError
from minitrain.config import ConfigError
from minitrain.train.run_config import run_config
from minitrain.train.trainer import Trainer

from tests.helpers.dist import run_main, run_ranks
from tests.helpers.tamper import read_manifest_json, replace_shard, resign, resign_file, resign_text

STEP = "step-000002"
SETTINGS = {"dist.nproc": 2, "train.zero": 1, "train.steps": 4, "train.log_every": 0}


def _save(topo, root):
    trainer = Trainer(run_config(cli_values=SETTINGS), topo)
    trainer.train_step()
    trainer.train_step()
    trainer.save_checkpoint(Path(root) / "checkpoints")


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("original")
    run_ranks(_save, 2, str(root))
    return root / "checkpoints"


@pytest.fixture
def run(original, tmp_path) -> Path:
    """A fresh copy of a 2-rank ZeRO-1 run's checkpoints (step 2), to attack."""
    shutil.copytree(original, tmp_path / "run" / "checkpoints")
    return tmp_path / "run"


def _metadata(step_dir: Path, name: str) -> dict:
    from safetensors import safe_open

    with safe_open(str(step_dir / name), framework="pt") as f:
        return f.metadata()


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(run: Path, match: str) -> None:
    """Refused by verification and by a resume (exit 2, one line), and nothing under the run changed."""
    step_dir = run / "checkpoints" / STEP
    with pytest.raises(CheckpointError, match=match):
        checkpoint.verify(step_dir)
    before = _snapshot(run)
    proc = run_main("train", "--nproc", "2", "--zero", "1", "--steps", "4", "--resume", str(step_dir),
                    "--out", str(run))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert _snapshot(run) == before


def test_an_untouched_copy_verifies_and_works_every_way(run):
    step_dir, manifest = checkpoint.verify(run / "checkpoints")
    assert step_dir.name == STEP and manifest["step"] == 2
    _use_every_way(run, step_dir)  # what the fuzz test below expects of any checkpoint it does not refuse
    assert _metadata(step_dir, "rank-00001.safetensors") == {"minitrain.written_by": "rank 1, step 2"}


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "rank-00000.safetensors/../x", "sub/rank-00000.safetensors"])
def test_a_file_outside_the_step_directory_is_refused(run, name):
    step_dir = run / "checkpoints" / STEP
    manifest = read_manifest_json(step_dir)
    manifest["files"][1]["name"] = name
    resign(step_dir, manifest)
    _refused(run, r"field files\[1\]\.name is invalid")


def test_an_edited_manifest_is_refused_unless_its_record_is_updated_too(run):
    step_dir = run / "checkpoints" / STEP
    manifest = read_manifest_json(step_dir)
    manifest["train_state"]["tokens_seen"] += 1
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    _refused(run, "does not match manifest.sha256: the manifest was changed after the save")
    (step_dir / "manifest.sha256").unlink()
    _refused(run, "manifest.sha256 is missing")


def test_a_step_directory_symlinked_or_copied_under_another_step_is_refused(run, tmp_path):
    checkpoints = run / "checkpoints"
    elsewhere = tmp_path / "other-run-step"
    shutil.move(checkpoints / STEP, elsewhere)
    (checkpoints / STEP).symlink_to(elsewhere, target_is_directory=True)
    _refused(run, "is a symlink")
    (checkpoints / STEP).unlink()
    shutil.copytree(elsewhere, checkpoints / STEP)  # back in place: verifies again
    checkpoint.verify(checkpoints / STEP)
    shutil.copytree(elsewhere, checkpoints / "step-000003")
    with pytest.raises(CheckpointError, match="field step is 2, but the directory is step-000003"):
        checkpoint.verify(checkpoints / "step-000003")


def test_two_ranks_shards_swapped_with_their_checksums_are_refused(run):
    step_dir = run / "checkpoints" / STEP
    a, b = step_dir / "rank-00000.safetensors", step_dir / "rank-00001.safetensors"
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes), b.write_bytes(a_bytes)
    resign_file(step_dir, a.name), resign_file(step_dir, b.name)
    _refused(run, "rank-00000.safetensors: written by rank 1, step 2, the manifest lists it as rank 0, step 2")


@pytest.mark.parametrize("attack,match", [
    ("longer", r"tensor 'optim.exp_avg' has shape \[15041\], the manifest says \[15040\]"),
    ("fp16", "tensor 'optim.exp_avg' is F16, the manifest says F32"),
    ("2-d", r"tensor 'optim.exp_avg' has shape \[2, 7520\]"),
    ("int32", "tensor 'optim.exp_avg' is I32"),
    ("missing", "tensor 'optim.exp_avg' is missing"),
    ("extra", "tensor 'optim.extra' is not in the manifest"),
    ("unsigned", "written by nobody it names"),
])
def test_a_replaced_shard_with_its_checksum_updated_is_refused_by_its_header(run, attack, match):
    step_dir, name = run / "checkpoints" / STEP, "rank-00001.safetensors"
    tensors = load_file(str(step_dir / name))
    metadata = _metadata(step_dir, name)
    m = tensors["optim.exp_avg"]
    if attack == "longer":
        tensors["optim.exp_avg"] = torch.cat([m, m[:1]])
    elif attack == "fp16":
        tensors["optim.exp_avg"] = m.half()
    elif attack == "2-d":
        tensors["optim.exp_avg"] = m.view(2, -1)
    elif attack == "int32":
        tensors["optim.exp_avg"] = m.to(torch.int32)
    elif attack == "missing":
        del tensors["optim.exp_avg"]
    elif attack == "extra":
        tensors["optim.extra"] = m.clone()
    else:
        metadata = None
    replace_shard(step_dir, name, tensors, metadata)
    _refused(run, match)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.pop("train_state"), r"field \(the whole manifest\) is invalid: .train_state. is a required property"),
    (lambda m: m.update(step="2"), "field step is invalid"),
    (lambda m: m["files"][0].update(bytes=-1), r"field files\[0\]\.bytes is invalid"),
    (lambda m: m["files"][0].update(sha256="zz"), r"field files\[0\]\.sha256 is invalid"),
    (lambda m: m["layout"].update(dp=3), "field layout .* does not multiply to world_size 2"),
    (lambda m: m["files"].pop(), "field files lists 1 files for world_size 2"),
    (lambda m: m["tensors"][0].update(pieces=[[0, 0, 10 ** 9]]), r"field tensors\[0\]\.pieces has"),
    (lambda m: m["flat"]["segments"][0].update(shape=[10 ** 6, 10 ** 6]), r"field flat\.segments\[0\] .* ends past"),
    (lambda m: m["train_state"]["loader"].pop("cursor"), r"field train_state\.loader is invalid"),
    (lambda m: m["flat"]["segments"][1].update(shape=[8, 32]), r"field flat\.segments\[2\]\.offset is 2560; .* start at 2304"),
    (lambda m: m["state_dict"][0].update(tensor="x"), r"field state_dict\[0\] is invalid"),
    # JSON Schema would count 3.0 as an integer; an offset or a count must be one
    (lambda m: m["tensors"][0]["pieces"][0].__setitem__(0, 0.0), r"field tensors\[0\]\.pieces\[0\]\[0\] is invalid"),
    (lambda m: m["flat"].update(numel=float(m["flat"]["numel"])), r"field flat\.numel is invalid"),
])
def test_a_malformed_manifest_is_refused_naming_the_field(run, edit, match):
    step_dir = run / "checkpoints" / STEP
    manifest = read_manifest_json(step_dir)
    edit(manifest)
    resign(step_dir, manifest)
    _refused(run, match)


# --- fuzzing: whatever the manifest says, a clean refusal or a checkpoint that works --------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
    | st.sampled_from(["../x", "/etc/passwd", "rank-00000.safetensors", "rank-00001.safetensors", "float16", ""]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=5)


def _paths(value, prefix=()) -> list[tuple]:
    """Every place in a manifest (of long lists, the first and last element)."""
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i in sorted({0, len(value) - 1}) if value else []:
            out += _paths(value[i], (*prefix, i))
    return out


def _edit(manifest: dict, path: tuple, action: str, value) -> None:
    parent = manifest
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if action == "delete":
        del parent[last]
    elif action == "nudge" and isinstance(parent[last], int) and not isinstance(parent[last], bool):
        parent[last] += 1 if value else -1
    else:
        parent[last] = value


def _use_every_way(run: Path, step_dir: Path) -> None:
    """What a user can do with a checkpoint: verify, inspect, consolidate, check a resume, load it."""
    from minitrain.apps import ckpt as ckpt_tool
    from minitrain.train.resume import check_resume
    from minitrain.runtime.topology import Topology

    checkpoint.verify(step_dir)
    ckpt_tool.inspect(str(step_dir))
    checkpoint.consolidated_state_dict(str(step_dir))
    check_resume(run_config(cli_values={**SETTINGS, "ckpt.resume": str(step_dir), "out": str(run)}))
    one = run_config(cli_values={**SETTINGS, "dist.nproc": 1, "train.batch_size": 8})
    Trainer(one, Topology.single()).load_checkpoint(step_dir)  # resharded to one process


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_manifest_edit_ends_in_a_clean_refusal_or_a_working_checkpoint(original, tmp_path_factory, data):
    run = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(original, run / "checkpoints")
    step_dir = run / "checkpoints" / STEP
    manifest = read_manifest_json(step_dir)
    path = data.draw(st.sampled_from(_paths(manifest)[1:]), label="field")
    action = data.draw(st.sampled_from(["replace", "delete", "nudge"]), label="action")
    _edit(manifest, path, action, data.draw(JSON, label="value"))
    resign(step_dir, manifest)
    before = _snapshot(run)
    try:
        _use_every_way(run, step_dir)
    except (CheckpointError, ConfigError) as e:  # exit 2 in the CLI: one line
        assert "\n" not in str(e), str(e)
    assert _snapshot(run) == before


def test_non_finite_parameters_or_optimizer_state_are_never_committed(tmp_path):
    from minitrain.runtime.topology import Topology

    one = run_config(cli_values={**SETTINGS, "dist.nproc": 1})
    for key in ("params", "optim.exp_avg_sq"):
        trainer = Trainer(one, Topology.single())
        trainer.train_step()
        held = trainer.strategy.flat.data if key == "params" else trainer.strategy.optimizer.exp_avg_sq
        held[3] = float("nan") if key == "params" else float("inf")
        root = tmp_path / key
        with pytest.raises(CheckpointError, match=f"'{key}' holds NaN or Inf values"):
            trainer.save_checkpoint(root)
        assert not (root / "latest").exists() and not list(root.glob("step-*"))


@pytest.mark.parametrize("argv,message", [
    (["--lr", "inf"], "train.lr must be a finite number, got inf"),
    (["--train.weight_decay", "nan"], "train.weight_decay must be a finite number, got nan"),
    (["--train.eps", "nan"], "train.eps must be a finite number"),
    (["--train.grad_clip", "nan"], "train.grad_clip must be a finite number"),
    (["--timeout-s", "inf"], "dist.timeout_s must be a finite number"),
    (["--bucket-mb", "inf"], "ddp.bucket_mb must be a finite number"),
    (["--nproc", "1000"], "--nproc 1000 ranks on one machine"),
])
def test_non_finite_settings_and_impossible_rank_counts_are_refused(tmp_path, argv, message):
    proc = run_main("train", *argv, "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("text", ["NaN", "Infinity", "1" * 5000, "[" * 100000 + "]" * 100000])
def test_json_that_only_python_accepts_is_refused(run, text):
    step_dir = run / "checkpoints" / STEP
    raw = (step_dir / "manifest.json").read_text().replace('"tokens_seen": ', f'"tokens_seen": {text}, "x": ', 1)
    resign_text(step_dir, raw)
    _refused(run, "is not valid JSON|is invalid")


@pytest.mark.parametrize("key,value", [("rng.numpy_gauss", torch.zeros(0, dtype=torch.float64)),
                                       ("rng.python", torch.zeros(3, dtype=torch.int64)),
                                       ("rng.torch", torch.zeros(7, dtype=torch.uint8))])
def test_a_random_state_of_the_wrong_length_is_refused(run, key, value):
    step_dir, name = run / "checkpoints" / STEP, "rank-00000.safetensors"
    tensors = load_file(str(step_dir / name))
    tensors[key] = value
    replace_shard(step_dir, name, tensors, _metadata(step_dir, name))
    _refused(run, f"tensor '{key}' has shape")


def _tiny_save(topo, root):
    import minitrain

    minitrain.init_distributed(topology=topo)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)  # 2 parameters over 3 ranks: rank 2's shard is padding only
    model, opt = minitrain.prepare(model, lambda params: torch.optim.AdamW(params, lr=0.1), zero=1)
    model(torch.ones(4, 1)).sum().backward()
    opt.step()
    opt.zero_grad()
    saved = str(minitrain.save_checkpoint(root, model, opt, step=1))
    try:  # strict JSON only: a manifest holding NaN would be refused when read back
        minitrain.save_checkpoint(root, model, opt, step=2, extra={"loss": float("nan")})
        refused = None
    except ValueError as e:
        refused = str(e)
    return saved, refused


def test_a_rank_whose_shard_is_all_padding_saves_a_checkpoint_that_verifies(tmp_path):
    saved, refused = run_ranks(_tiny_save, 3, str(tmp_path))[0]
    assert "extra must be plain JSON" in refused and not (tmp_path / "step-000002").exists()
    step_dir = Path(saved)
    _, manifest = checkpoint.verify(step_dir)
    padding_only = [t for t in manifest["tensors"] if t["file"] == "rank-00002.safetensors" and "pieces" in t]
    assert padding_only and all(t["pieces"] == [] and t["shape"] == [1] for t in padding_only)
