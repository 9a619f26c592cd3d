import pytest

from minitrain.config import ConfigError, build_config, from_dict, load_toml

from minitrain.train.run_config import run_config


def test_defaults_are_the_tiny_model():
    cfg = run_config()
    m = cfg.model
    assert (m.n_layer, m.d_model, m.n_head, m.vocab_size, m.seq_len, cfg.train.batch_size) == (2, 32, 4, 64, 16, 4)


def test_precedence_defaults_preset_file_cli(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('out = "runs/x"\n[model]\npreset = "small"\nn_layer = 3\n[train]\nlr = 0.01\nsteps = 7\n')
    cfg = build_config(load_toml(f), {"train.steps": 9})
    assert cfg.model.d_model == 256  # from the preset the file names
    assert cfg.model.n_layer == 3  # file beats preset
    assert cfg.train.lr == 0.01 and cfg.train.steps == 9  # flag beats file
    assert cfg.out == "runs/x"
    assert from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("values, message", [
    ({"model.preset": "huge"}, "unknown preset 'huge'"),
    ({"model.n_head": 5}, "does not divide"),
    ({"dist.nproc": 0}, "world size must be at least 1"),
    ({"train.zero": 4}, "train.zero must be one of"),
    ({"train.min_lr_ratio": 1.5}, "min_lr_ratio"),
    ({"train.steps": 1.5}, "invalid int"),
    ({"nonsense.key": 1}, "unknown setting"),
    ({"dist.backend": "nccl", "dist.nproc": 64}, "needs a CUDA device per rank"),
])
def test_bad_values_raise_config_error(values, message):
    with pytest.raises(ConfigError, match=message):
        run_config(cli_values=values)


def test_bad_toml_is_a_config_error(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_toml(f)
