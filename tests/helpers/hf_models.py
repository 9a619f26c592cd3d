"""Tiny Hugging Face models for the API tests, built from configs here (random init, nothing downloaded),
and the plain single-process PyTorch training loop every API parity test compares against."""
from __future__ import annotations

import functools

import torch

VOCAB, SEQ = 64, 8
KINDS = ("llama-tied", "llama", "gpt2")


def make_model(kind: str, seed: int = 0, layers: int = 2):
    """A model of `kind` (2 layers by default) whose parameters are float64 and whose buffers keep their dtype (the rotary
    inv_freq stays float32, as after loading a checkpoint in float64), with its final norm frozen."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=layers, n_head=2,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)  # deterministic: the runs are compared value for value
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                       max_position_embeddings=SEQ,
                                       tie_word_embeddings=kind == "llama-tied", bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.data = p.data.double()
    frozen_parameter(model).requires_grad_(False)
    return model


def tiny_moe(seed: int = 0, kind: str = "mixtral", **options):
    """A tiny Hugging Face mixture of experts in float64: Mixtral, or OLMoE (whose experts module has the same
    layout, named by its own base_model_ep_plan). options: more config fields (output_router_logits=True, say)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=8, num_experts_per_tok=2, bos_token_id=0,
                 eos_token_id=0)
    if kind == "olmoe":
        cfg = transformers.OlmoeConfig(**shape, **options, num_experts=4, pad_token_id=0)
        make = transformers.OlmoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**shape, **options, num_local_experts=4, router_jitter_noise=0.0)
        make = transformers.MixtralForCausalLM
    cfg._experts_implementation = "eager"  # its per-expert loop: the grouped matmul has no float64
    model = make(cfg)
    for p in model.parameters():
        p.data = p.data.double()
    return model


def frozen_parameter(model) -> torch.nn.Parameter:
    return model.transformer.ln_f.weight if hasattr(model, "transformer") else model.model.norm.weight


def tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def param_groups(model) -> list[dict]:
    """nanoGPT's split: matrices and embeddings decay, biases and norms do not."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]


OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95)),
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
}


def batches(steps: int, global_batch: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (global_batch, SEQ), generator=g) for _ in range(steps)]


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in the logits' own dtype (float64 here; Hugging Face's built-in loss upcasts
    to float32, which would hide everything below 1e-7)."""
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def reference_run(kind: str, optimizer: str, steps: list[torch.Tensor], max_norm: float, layers: int = 2) -> dict:
    """Plain PyTorch on one process: the unwrapped model, torch.optim, torch.nn.utils.clip_grad_norm_, each
    step on the whole global batch. Returns losses, norms and the final state_dict."""
    model = make_model(kind, layers=layers)
    opt = OPTIMIZERS[optimizer](param_groups(model))
    losses, norms = [], []
    for x in steps:
        loss = lm_loss(model, x)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                          max_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
