"""`minitrain sample DIR --prompt TEXT`: text from a model `minitrain export` wrote.

DIR alone is enough: config.json rebuilds the model, model.safetensors fills it (strict: every
key, nothing else), tokenizer.json turns the prompt into ids and the ids back into text. A model
trained on a synthetic corpus has no tokenizer: its prompt and output are token ids.

Sampling is the usual loop: crop the context to the model's seq_len, take the last position's
logits, divide by the temperature (0 = always the most likely token), keep the top k, draw. The
draw uses its own torch.Generator seeded with --seed, on the CPU: the same seed gives the same
text, whatever else the process did.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..config import ModelConfig, check_model, check_seed
from ..errors import ConfigError
from .export import CONFIG, FORMAT, WEIGHTS
from ..models.minigpt.model import MiniGPT


def load_exported(directory: str) -> tuple[MiniGPT, dict]:
    """The model (eval mode, the dtype it was saved in) and its config.json; ConfigError if DIR is not an export."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    if not (d / CONFIG).is_file() or not (d / WEIGHTS).is_file():
        raise ConfigError(f"{d} is not a model directory: expected {CONFIG} and {WEIGHTS} (write one with "
                          "`minitrain export RUN OUT`)")
    try:
        config = json.loads((d / CONFIG).read_text())
        if config.get("format") != FORMAT:
            raise ValueError(f"format {config.get('format')!r}, expected {FORMAT!r}")
        model_cfg = ModelConfig(**config["model"])
        check_model(model_cfg)
        state = load_file(str(d / WEIGHTS))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError, ConfigError) as e:
        raise ConfigError(f"cannot read the model in {d}: {e}") from None
    dtype = next(iter(state.values())).dtype
    model = MiniGPT(model_cfg).to(dtype)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        detail = " ".join(line.strip() for line in str(e).splitlines()[1:])[:300]
        raise ConfigError(f"{d / WEIGHTS} does not fit {d / CONFIG}: {detail}") from None
    return model.eval(), config


@torch.no_grad()
def generate(model: MiniGPT, ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
             seed: int) -> list[int]:
    """`ids` followed by max_new_tokens sampled ones."""
    generator = torch.Generator().manual_seed(seed)
    seq_len, vocab = model.cfg.seq_len, model.cfg.vocab_size
    out = torch.tensor([ids], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(out[:, -seq_len:])[0, -1].double()  # (vocab,): float64 so the draw is the same on any dtype
        if temperature == 0:
            token = logits.argmax()
        else:
            logits = logits / temperature
            if 0 < top_k < vocab:
                cutoff = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]
        out = torch.cat([out, token.view(1, 1)], dim=1)
    return out[0].tolist()


def sample(directory: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> str:
    """The prompt and its continuation, as text (or as ids for a model without a tokenizer)."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not 0 <= temperature < float("inf"):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 = the most likely token each time), got "
                          f"{temperature}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--prompt is not valid UTF-8 text") from None
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 = every token), got {top_k}")
    check_seed("--seed", seed)
    model, config = load_exported(directory)
    tokenizer = _tokenizer(Path(directory), config)
    ids = _prompt_ids(prompt, tokenizer, model.cfg.vocab_size)
    out = generate(model, ids, max_new_tokens, temperature, top_k, seed)
    if tokenizer is None:
        return " ".join(map(str, out))
    from ..corpus.tokenizer import decode

    return decode(tokenizer, out)


def _tokenizer(directory: Path, config: dict):
    if not config.get("tokenizer"):
        return None
    from ..corpus.tokenizer import load_tokenizer

    return load_tokenizer(directory / config["tokenizer"])


def _prompt_ids(prompt: str, tokenizer, vocab: int) -> list[int]:
    if tokenizer is None:
        words = prompt.split()
        if not words or not all(w.isascii() and w.isdigit() for w in words):
            raise ConfigError("this model has no tokenizer (its corpus had none): give --prompt as token ids "
                              f"separated by spaces, e.g. --prompt '1 2 3', got {prompt!r}")
        ids = [int(w) for w in words]
    else:
        from ..corpus.tokenizer import EOT, encode

        ids = encode(tokenizer, prompt)
        if not ids and tokenizer.token_to_id(EOT) is not None:
            ids = [tokenizer.token_to_id(EOT)]  # an empty prompt starts where a document starts
    if not ids:
        raise ConfigError("--prompt is empty and the tokenizer has no end-of-text token to start from; give a prompt")
    if max(ids) >= vocab or min(ids) < 0:
        raise ConfigError(f"the prompt holds token ids outside the model's vocabulary 0..{vocab - 1}")
    return ids


def add_parser(sub) -> argparse.ArgumentParser:
    sampler = sub.add_parser("sample", help="generate text from an exported model",
                             description="Load a directory `minitrain export` wrote and continue --prompt. The same "
                             "--seed gives the same text. A model trained on a synthetic corpus has no tokenizer: "
                             "its prompt and output are token ids.",
                             epilog='Example:\n  minitrain sample runs/notes/model --prompt "The river" '
                             "--max-new-tokens 80 --temperature 0.8 --top-k 40 --seed 1",
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    sampler.add_argument("model_dir", metavar="DIR", help="a directory `minitrain export` wrote")
    sampler.add_argument("--prompt", default="", help="text to continue ('' = start of a document)")
    sampler.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate (default 100)")
    sampler.add_argument("--temperature", type=float, default=1.0, metavar="T",
                         help="divides the logits; lower is more predictable, 0 = always the most likely (default 1)")
    sampler.add_argument("--top-k", type=int, default=40, metavar="K", help="draw from the K most likely tokens; "
                         "0 = all (default 40)")
    sampler.add_argument("--seed", type=int, default=0, metavar="S", help="the draw's seed (default 0)")

    return sampler


def run(args) -> int:
    print(sample(args.model_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    return 0
