"""minitrain: a small, readable, exactly correct distributed training framework.

Bring your own model, optimizer and loop (see api/__init__.py):

    import minitrain
    minitrain.init_distributed()
    model, optimizer = minitrain.prepare(model, functools.partial(torch.optim.AdamW, lr=1e-3), zero=1)
"""
from __future__ import annotations

import importlib

from .version import __version__

# The API's names and the module each comes from, imported when first used: `import minitrain` alone loads no
# torch, so a process that needs one corner of the package (a `data prepare` worker) starts in a fraction of the
# time. `from minitrain import prepare`, `minitrain.prepare` and `minitrain.api` all work as if imported eagerly.
_API = {name: ".api" for name in (
    "GradScaler", "PipelineSplit", "PreparedOptimizer", "barrier", "cleanup", "clip_grad_norm_", "dp_rank",
    "dp_world_size", "full_state_dict", "init_distributed", "is_main_process", "is_server", "load_checkpoint",
    "no_sync", "pipeline_step", "prepare", "save_checkpoint", "serve", "wrap_for_ddp")}
_API |= {"ModelPlan": ".parallel.core.model_plan", "Prefetcher": ".utils.prefetch",
         "TokenShards": ".corpus.token_shards"}

__all__ = sorted([*_API, "__version__"])


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name], __name__), name)
    else:  # a subpackage or module not imported yet (minitrain.api, minitrain.checkpoint, ...)
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
