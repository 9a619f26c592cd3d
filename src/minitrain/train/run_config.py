"""A run's configuration, checked against what is outside the settings too: the corpus on disk (its vocabulary,
which the model takes unless one is given; its held-out split, for --eval-every) and the tracking packages the
--log switches need, disk offload's directory, the object storage checkpoints go to. The settings alone are config/'s; this is what `minitrain train` and the tests build runs
from."""
from __future__ import annotations

from ..checkpoint.remote import check_location
from ..config import RunConfig, build_config
from ..data import check_corpus, check_eval_split, corpus_vocab_size
from .offload_files import check_offload_directory
from .ps_run import check_servers
from .tracking import check_available


def run_config(file_values: dict[str, object] | None = None,
               cli_values: dict[str, object] | None = None) -> RunConfig:
    """defaults < preset < file < command line, the model's vocabulary from a tokenized corpus, validated: the
    settings (RunConfig.validate) and what they name (check_run). ConfigError, one line, for anything wrong."""
    return check_run(build_config(file_values, cli_values, vocab_of=corpus_vocab_size).validate())


def check_run(cfg: RunConfig) -> RunConfig:
    """What the settings name must exist and fit: the corpus (and its held-out split, with --eval-every) and an
    installed package for each tracking sink switched on."""
    check_corpus(cfg)
    if cfg.eval.every:
        check_eval_split(cfg)
    check_available(cfg.log)  # a sink switched on without its package: refused before the run
    check_offload_directory(cfg)
    if cfg.ckpt.dir:  # reachable, and its package installed: found now, not at the first save
        check_location(cfg.ckpt.dir)
    if cfg.ps.servers:  # enough of the model for every server
        check_servers(cfg)
    return cfg
