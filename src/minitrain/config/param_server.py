"""The ps section: parameter-server training, and what it does not combine with yet."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .fields import opt, require_non_negative

if TYPE_CHECKING:  # the type only: schema.py puts the sections together and imports this module
    from .schema import RunConfig


@dataclass
class ParameterServerConfig:
    """Parameter-server training (minitrain.parallel's parameter server): the last S ranks hold the parameters
    and optimizer state, the others compute gradients."""

    servers: int = opt(0, "ranks that are parameter servers, each holding a contiguous shard of the parameters and "
                       "its optimizer state; the other ranks are workers that push gradients and pull parameters "
                       "(0 = no parameter servers: data parallel or ZeRO)")
    staleness: int = opt(0, "K: a worker may run up to K steps ahead of the slowest worker (stale-synchronous "
                         "parallel), computing on parameters that miss at most the K latest updates; 0 = "
                         "synchronous, equal to data parallel over the workers")
    elastic: bool = opt(False, "a worker (other than worker 0, which speaks for the run) that dies is left out: the "
                        "servers complete every later update with the other workers' gradients and the run goes on, "
                        "its data shard skipped; needs --ps.staleness 1 or more and --nproc (torchrun's agent ends "
                        "every rank when one fails)")


def check_parameter_servers(cfg: RunConfig) -> None:
    """What parameter servers combine with so far (the world's size is checked again by the ranks, which know it
    under torchrun)."""
    ps, d, t = cfg.ps, cfg.dist, cfg.train
    require_non_negative("ps.servers", ps.servers)
    require_non_negative("ps.staleness", ps.staleness)
    if not ps.servers:
        if ps.staleness or ps.elastic:
            raise ConfigError(f"--ps.{'staleness' if ps.staleness else 'elastic'} needs parameter servers "
                              "(--ps.servers S)")
        return
    if ps.elastic and not ps.staleness:
        raise ConfigError("--ps.elastic needs --ps.staleness 1 or more: at K = 0 the workers exchange every step's "
                          "statistics, which a worker that died would hold up")
    if ps.elastic and "WORLD_SIZE" in os.environ:
        raise ConfigError("--ps.elastic needs --nproc: under torchrun its agent ends every rank when one fails")
    if ps.servers >= d.nproc and "WORLD_SIZE" not in os.environ:
        raise ConfigError(f"--ps.servers {ps.servers} leaves no worker among --nproc {d.nproc} ranks; give fewer "
                          "servers or more ranks")
    clashes = [name for name, on in (("--tp", d.tp > 1), ("--pp", d.pp > 1), ("--dist.ep", d.ep > 1),
                                     ("--dist.cp", d.cp > 1), ("--zero", t.zero > 0),
                                     ("--dist.microbatches", d.microbatches > 1),
                                     ("--precision fp16", t.precision == "fp16"), ("--backend nccl",
                                     d.backend == "nccl"), ("--train.offload", t.offload != "none"),
                                     ("--global-batch", t.global_batch > 0)) if on]
    if clashes:
        raise ConfigError(f"--ps.servers trains the workers' whole model with its optimizer on the servers, over gloo; "
                          f"it does not combine with {', '.join(clashes)}")
    saves = [name for name, on in (("--ckpt.every_minutes", cfg.ckpt.every_minutes), ("--ckpt.dir", cfg.ckpt.dir),
                                   ("--ckpt.async_save", cfg.ckpt.async_save)) if on]
    if saves:
        raise ConfigError(f"a parameter-server run saves synchronously into OUT, every so many steps; drop "
                          f"{', '.join(saves)}")
    if ps.staleness and (cfg.ckpt.every_steps or cfg.ckpt.resume):
        raise ConfigError("checkpoints during a parameter-server run (--ckpt.every_steps, --ckpt.resume) need "
                          "--ps.staleness 0 for now: under K > 0 each worker would decide a rollback on its own "
                          "losses (the final save is kept)")
    if ps.staleness and t.memory_profile:
        raise ConfigError("--train.memory_profile with --ps.staleness > 0: its report gathers every worker at the end, "
                          "where a worker that stopped early is no longer waiting; profile at K = 0")
    if ps.staleness and cfg.eval.every:
        raise ConfigError("--eval.every with --ps.staleness > 0: workers at different steps hold different "
                          "parameters, so there is no one model to evaluate at a step; evaluate at K = 0")
