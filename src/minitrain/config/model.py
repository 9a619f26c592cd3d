"""The model section: the shape of the MiniGPT a run trains (a mixture of experts included), the named presets,
and check_model(), which an exported model's config.json passes too."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .fields import opt, require_choice, require_positive


@dataclass
class ModelConfig:
    preset: str = opt("tiny", "named starting point: " + "tiny | small | gpt2-124m; explicit model fields override it")
    n_layer: int = opt(2, "number of transformer blocks")
    d_model: int = opt(32, "width of the residual stream")
    n_head: int = opt(4, "attention heads; must divide d_model")
    vocab_size: int = opt(64, "token vocabulary; must cover the corpus. With --corpus text or a prepared directory "
                          "it is taken from the corpus unless given here")
    seq_len: int = opt(16, "context length in tokens, also the length of every training example")
    d_ff: int = opt(0, "hidden width of the MLP; 0 means 4 * d_model")
    tie_weights: bool = opt(False, "share the token embedding with the LM head")
    attention: str = opt("sdpa", "sdpa (PyTorch's fused scaled_dot_product_attention: flash attention where "
                         "available) | explicit (the scores, mask and softmax spelled out: for teaching)")
    moe_experts: int = opt(0, "mixture of experts: this many expert MLPs per block, a router picking moe_top_k "
                           "of them for each token (0: one dense MLP)")
    moe_top_k: int = opt(2, "experts each token is sent to (their outputs weighted by the router's renormalised "
                         "probabilities)")
    moe_capacity_factor: float = opt(0.0, "0: dropless (every token reaches its experts); else each expert takes "
                                     "at most ceil(factor x tokens x top_k / experts) per forward, the first in "
                                     "token order, the rest dropped (counted)")
    moe_aux_loss_coef: float = opt(0.01, "weight of the load-balancing loss (Switch/GShard: experts x sum of "
                                   "token fraction x mean router probability; 1 when balanced)")
    moe_balance: str = opt("global", "global: the balancing loss's token fractions f_e counted over the whole "
                           "global batch (an all-reduce of E numbers per MoE layer), so N ranks train as one process "
                           "| rank: over each rank's own tokens (Megatron-LM's and DeepSpeed's default)")
    moe_z_loss_coef: float = opt(0.0, "weight of the router z-loss (ST-MoE: mean squared log-sum-exp of the "
                                 "router logits), 0 to leave it out")

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16, d_ff=0, tie_weights=False),
    "small": dict(n_layer=4, d_model=256, n_head=8, vocab_size=256, seq_len=128, d_ff=0, tie_weights=False),
    # GPT-2 small; vocab padded from 50257 to a multiple of 64 as nanoGPT does.
    "gpt2-124m": dict(n_layer=12, d_model=768, n_head=12, vocab_size=50304, seq_len=1024, d_ff=0, tie_weights=True),
}


def check_model(m: ModelConfig) -> None:
    """ConfigError unless the model's settings build a MiniGPT (also for an exported model's config.json)."""
    if m.preset not in PRESETS:
        raise ConfigError(f"unknown preset '{m.preset}'; choose one of: {', '.join(PRESETS)}")
    for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
        value = getattr(m, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"model.{name} must be an integer, got {value!r}")
        require_positive(f"model.{name}", value)
    if m.d_model % m.n_head:
        raise ConfigError(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}; "
                          "pick a head count that divides the width")
    if not isinstance(m.d_ff, int) or m.d_ff < 0:
        raise ConfigError(f"model.d_ff must be >= 0 (0 means 4 * d_model), got {m.d_ff}")
    require_choice("model.attention", m.attention, ("sdpa", "explicit"))
    _check_experts(m)


def _check_experts(m: ModelConfig) -> None:
    for name in ("moe_experts", "moe_top_k"):
        value = getattr(m, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"model.{name} must be an integer >= 0, got {value!r}")
    if not m.moe_experts:
        return
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must lie in [1, model.moe_experts={m.moe_experts}]: "
                          "each token goes to that many different experts")
    require_choice("model.moe_balance", m.moe_balance, ("global", "rank"))
    if m.moe_capacity_factor < 0:
        raise ConfigError(f"model.moe_capacity_factor must be >= 0 (0: dropless), got {m.moe_capacity_factor}")
    for name in ("moe_aux_loss_coef", "moe_z_loss_coef"):
        if getattr(m, name) < 0:
            raise ConfigError(f"model.{name} must be >= 0, got {getattr(m, name)}")
