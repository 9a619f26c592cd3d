"""minitrain: a small, readable, exactly correct distributed training framework.

Bring your own model, optimizer and loop (see api/__init__.py):

    import minitrain
    minitrain.init_distributed()
    model, optimizer = minitrain.prepare(model, functools.partial(torch.optim.AdamW, lr=1e-3), zero=1)
"""

from .api import (
                  GradScaler,
                  MoEStats,
                  PipelineSplit,
                  PreparedOptimizer,
                  barrier,
                  cleanup,
                  clip_grad_norm_,
                  context_shard,
                  dp_rank,
                  dp_world_size,
                  full_state_dict,
                  init_distributed,
                  is_main_process,
                  is_server,
                  load_checkpoint,
                  moe_stats,
                  no_sync,
                  pipeline_step,
                  prepare,
                  save_checkpoint,
                  serve,
                  wrap_for_ddp,
)
from .parallel.core.model_plan import ModelPlan
from .utils.prefetch import Prefetcher

from .version import __version__

__all__ = ["GradScaler", "ModelPlan", "MoEStats", "PipelineSplit", "Prefetcher", "PreparedOptimizer", "TokenShards",
           "__version__", "barrier", "cleanup", "clip_grad_norm_", "context_shard",
           "dp_rank", "dp_world_size", "full_state_dict", "init_distributed", "is_main_process", "is_server",
           "load_checkpoint", "moe_stats", "no_sync", "pipeline_step", "prepare", "save_checkpoint", "serve",
           "wrap_for_ddp"]


def __getattr__(name: str):
    # The data loader for sharded corpora loads when first asked for: `import minitrain` stays the API alone.
    if name == "TokenShards":
        from .corpus.token_shards import TokenShards

        return TokenShards
    raise AttributeError(f"module 'minitrain' has no attribute {name!r}")
