import ast
from pathlib import Path

import pytest
import torch

import minitrain.models.minigpt.model as model_module
from minitrain.config import PRESETS, ModelConfig
from minitrain.models.minigpt.model import MiniGPT


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**PRESETS["tiny"], **overrides})


def test_logits_and_loss_shapes():
    torch.manual_seed(0)
    cfg = tiny()
    m = MiniGPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    assert m(idx).shape == (3, cfg.seq_len, cfg.vocab_size)
    loss = m(idx, idx)
    assert loss.shape == () and torch.isfinite(loss)
    # At init the prediction is near uniform: loss close to ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.1


def test_fused_and_explicit_attention_agree_in_float64():
    torch.manual_seed(0)
    fused = MiniGPT(tiny(attention="sdpa", n_layer=3)).double()
    explicit = MiniGPT(tiny(attention="explicit", n_layer=3)).double()
    explicit.load_state_dict(fused.state_dict())
    idx = torch.randint(0, 64, (3, 16))
    torch.testing.assert_close(fused(idx), explicit(idx), rtol=0, atol=1e-12)
    fused(idx, idx).backward()
    explicit(idx, idx).backward()
    for (name, a), b in zip(fused.named_parameters(), explicit.parameters()):
        assert a.grad.abs().max() > 0, name
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_causal_mask_hides_the_future(attention):
    torch.manual_seed(0)
    m = MiniGPT(tiny(attention=attention)).double()
    idx = torch.randint(0, 64, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 7) % 64
    a, b = m(idx), m(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-12)
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-3  # and the future positions do see the change


def test_shorter_sequences_and_too_long_rejected():
    m = MiniGPT(tiny())
    assert m(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 64)
    with pytest.raises(ValueError, match="exceeds seq_len"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_weights_untied_by_default_and_tied_on_request():
    untied, tied = MiniGPT(tiny()), MiniGPT(tiny(tie_weights=True))
    assert untied.head.weight is not untied.tok_emb.weight
    assert tied.head.weight is tied.tok_emb.weight
    assert tied.num_params() == untied.num_params() - 64 * 32


def test_gpt2_124m_preset_has_gpt2_size():
    cfg = ModelConfig(preset="gpt2-124m", **PRESETS["gpt2-124m"])
    with torch.device("meta"):
        m = MiniGPT(cfg)
    L, C, V, T = 12, 768, 50304, 1024
    per_block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    expected = V * C + T * C + L * per_block + 2 * C  # tied head adds nothing
    assert m.num_params() == expected
    assert 124e6 < expected < 125e6


def test_model_file_imports_nothing_distributed():
    tree = ast.parse(Path(model_module.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if "distributed" in n or n.endswith(("comm", "topology", "parallel"))]
