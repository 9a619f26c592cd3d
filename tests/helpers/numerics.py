"""Numerical facts the parity tests rely on."""
import torch

from minitrain.config import build_config
from minitrain.models.minigpt.model import MiniGPT
from minitrain.parallel.core.flat_parameters import FlatParameters

# One process against ranks in float32, key biases left out: how far Adam may carry the rounding of a different
# summation order in 5 steps at lr 1e-2. It moves an element whose gradient is near zero by lr * m / sqrt(v), which
# magnifies that rounding: 1.02e-6 on one element of 30016 on an Intel Xeon, under 1e-6 on AMD EPYC. A wrong
# gradient or update moves elements by about lr.
FLOAT32_VS_ONE_PROCESS = 5e-6


def key_bias_mask(numel: int) -> torch.Tensor:
    """Flat elements of every block's key bias (the middle third of attn.qkv.bias) in the
    tiny model's flat parameter vector.

    Its exact gradient is zero: it adds q.b_k to every score of a softmax row, which the
    softmax ignores. In float32 the "gradient" is rounding residue whose value depends on
    the reduction order, and Adam (dividing by sqrt(v)) turns that residue into steps, so
    two correct float32 implementations drift apart there and nowhere else. Float64 runs
    hold them to 1e-12; test_ddp.test_key_bias_gradient_is_exactly_zero proves the premise.
    """
    flat = FlatParameters(MiniGPT(build_config().model), world_size=1)
    mask = torch.zeros(numel, dtype=torch.bool)
    for s in flat.segments:
        if s.name.endswith("attn.qkv.bias"):
            third = s.numel // 3
            mask[s.offset + third:s.offset + 2 * third] = True
    return mask


def assert_bit_equal(a, b, where: str) -> None:
    """Two states (dicts, lists, tuples, tensors and plain values, nested) equal bit for bit: the same keys and
    lengths, each tensor of the same dtype and torch.equal, each other value ==; `where` names the first that
    is not."""
    assert_states_match(a, b, where, atol=None)


def assert_states_match(a, b, where: str, atol: float | None) -> None:
    """assert_bit_equal, or with `atol` each tensor within it of the other (in float64) instead."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_states_match(a[key], b[key], f"{where}.{key}", atol)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_states_match(x, y, f"{where}[{i}]", atol)
    elif isinstance(a, torch.Tensor) and atol is None:
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, torch.Tensor):
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        assert diff <= atol, f"{where}: off by {diff:.3g}"
    else:
        assert a == b, f"{where}: {a} != {b}"
