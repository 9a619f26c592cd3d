"""Resuming a run: which checkpoint (--resume auto: the newest that verifies), and whether it fits this run. Checked
before any rank starts (check_resume): a checkpoint of another model, dtype, corpus, seed or data order is refused
with one line; settings that only change the steps to come make a warm restart, said in a note."""
from __future__ import annotations

from pathlib import Path

from .. import checkpoint
from ..checkpoint import remote
from ..config import ConfigError, RunConfig, build_config, field_specs
from ..data import num_examples, run_corpus_fingerprint


def resume_path(cfg: RunConfig, warnings: list[str] | None = None) -> Path | None:
    """Where to resume from: None (fresh), the newest checkpoint under OUT that verifies (auto),
    or PATH."""
    if not cfg.ckpt.resume:
        return None
    if cfg.ckpt.resume == "auto":
        if cfg.ckpt.dir:  # the store's newest, fetched into OUT/checkpoints unless a local one is as new
            remote.newest_locally(cfg.ckpt.dir, Path(cfg.out) / "checkpoints")
        return checkpoint.find_latest(cfg.out, warnings)
    return checkpoint.resolve(cfg.ckpt.resume)


# Settings that change the arithmetic of the steps still to come but not what the checkpoint holds: a
# resume with other values continues as a warm restart (said in a note), not a bit-identical continuation.
# The model, the dtypes and the data (corpus, seed, examples per micro-batch) must match: refused otherwise.
WARM_RESTART_FIELDS = ("steps", "warmup_steps", "lr", "min_lr_ratio", "grad_accum", "weight_decay", "beta1",
                       "beta2", "eps", "grad_clip", "loss_scale_window")


# Settings newer than some checkpoints' manifests (whose runs had the default).
FIELDS_ADDED_LATER = ("train.global_batch", "train.stop_at")


class RunFinished(Exception):
    """--resume auto found the run already at its last step: nothing to do (exit 0)."""


def saved_run_config(step_dir: Path, saved: dict) -> dict:
    """The run config a `minitrain train` checkpoint recorded, every section and field present and of its
    type (as a config file's would be), as to_dict() gives it; CheckpointError naming what is wrong."""
    if "prepare" in saved:
        raise checkpoint.CheckpointError(f"checkpoint {step_dir} was saved by minitrain.save_checkpoint, not by "
                                         "`minitrain train`: load it with minitrain.load_checkpoint")
    flat: dict[str, object] = {}
    for section, values in saved.items():
        if isinstance(values, dict) and section != "out":
            flat.update({f"{section}.{key}": value for key, value in values.items()})
        else:
            flat[section] = values
    # A checkpoint from before a field existed ran with that field's default.
    missing = sorted({key for key, _, _, _ in field_specs() if key.startswith(("model.", "train."))}
                     - set(flat) - set(FIELDS_ADDED_LATER))
    try:
        if missing:
            raise ConfigError(f"'{missing[0]}' is missing")
        return build_config(file_values=flat).to_dict()
    except ConfigError as e:
        raise checkpoint.CheckpointError(f"checkpoint {step_dir}: the run config in its manifest is unusable: {e}") \
            from None


def check_resume(cfg: RunConfig) -> list[str]:
    """Before any rank starts: refuse a resume checkpoint that is corrupt or does not fit
    this run (ConfigError / CheckpointError, one line each); return notes worth printing.
    With --resume auto the checkpoint chosen here is pinned in cfg, so every rank loads it."""
    notes: list[str] = []
    auto = cfg.ckpt.resume == "auto"
    path = resume_path(cfg, notes)
    if path is None:
        return notes
    cfg.ckpt.resume = str(path)
    step_dir, manifest = checkpoint.verify(path)
    saved = saved_run_config(step_dir, manifest["config"])
    mine = cfg.to_dict()
    diff = [k for k in mine["model"] if k != "preset" and saved["model"].get(k) != mine["model"][k]]
    if diff:
        raise checkpoint.CheckpointError(f"checkpoint {step_dir} has a different model: " + ", ".join(
            f"{k}={saved['model'].get(k)!r} (this run {mine['model'][k]!r})" for k in diff))
    for key in ("dtype", "precision"):
        theirs = saved["train"].get(key, "fp32")  # checkpoints from before --precision trained in fp32
        if theirs != mine["train"][key]:
            raise checkpoint.CheckpointError(f"checkpoint {step_dir} was trained with --{key} {theirs}, "
                                             f"this run uses --{key} {mine['train'][key]}")
    if manifest["step"] == cfg.train.steps and auto:
        raise RunFinished(f"the run in {cfg.out} already finished: its checkpoint {step_dir.name} is at step "
                          f"{cfg.train.steps} of --steps {cfg.train.steps}; nothing to do (ask for more --steps to "
                          "continue it)")
    if cfg.train.stop_at and manifest["step"] >= cfg.train.stop_at:
        raise ConfigError(f"checkpoint {step_dir} is at step {manifest['step']}, not before --stop-at "
                          f"{cfg.train.stop_at}; ask for a later --stop-at (or 0 to run to --steps)")
    if manifest["step"] >= cfg.train.steps:
        raise ConfigError(f"checkpoint {step_dir} is at step {manifest['step']}; ask for more --steps to continue")
    ours = run_corpus_fingerprint(cfg)
    if manifest["train_state"]["corpus_sha256"] != ours:
        raise ConfigError(f"checkpoint {step_dir} was trained on another corpus (sha256 "
                          f"{manifest['train_state']['corpus_sha256'][:12]}..., this run's {ours[:12]}...); resume "
                          "with the same --corpus and --data.corpus_seed")
    loader = manifest["train_state"]["loader"]
    dp = cfg.data_parallel_ranks  # data-parallel replicas: each reads its own batch
    global_batch = cfg.train.batch_size * dp
    if loader["global_batch"] != global_batch:
        fits = loader["global_batch"] % dp == 0
        hint = f" (e.g. --batch-size {loader['global_batch'] // dp} with {dp} data-parallel ranks)" if fits else ""
        raise ConfigError(f"checkpoint {step_dir} was saved with batch_size x data-parallel ranks = "
                          f"{loader['global_batch']} examples per micro-batch, this run has {global_batch}; keep the "
                          f"product equal{hint} so the data order continues exactly")
    if loader["seed"] != cfg.train.seed:
        raise ConfigError(f"checkpoint {step_dir} was saved with --seed {loader['seed']}, this run has "
                          f"{cfg.train.seed}; use the same seed to continue the same data order")
    if loader["num_examples"] != num_examples(cfg):
        raise ConfigError(f"checkpoint {step_dir} was trained on a corpus of {loader['num_examples']} examples, "
                          f"this run's corpus has {num_examples(cfg)}; resume with the same --corpus")
    changed = [f"{k} {saved['train'][k]} -> {mine['train'][k]}" for k in WARM_RESTART_FIELDS
               if saved["train"][k] != mine["train"][k]]
    if changed:
        notes.append(f"settings differ from the checkpoint's run ({', '.join(changed)}): "
                     "training continues as a warm restart, not a bit-identical continuation")
    return notes
