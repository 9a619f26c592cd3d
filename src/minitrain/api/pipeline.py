"""prepare's pipeline arguments, checked before any rank splits anything: the split of the model into pieces, the
schedule, and what each schedule cannot run with."""
from __future__ import annotations

from torch import nn

from ..parallel.pipeline_parallel.schedules import SCHEDULES
from ..parallel.pipeline_parallel.split import PipelineSplit, check_pieces, check_split, cross_stage_ties


def pipeline_split(model: nn.Module, pp: int, pp_split, microbatches: int, schedule: str, virtual_stages: int | None,
                   others: dict) -> tuple[PipelineSplit | None, int]:
    """The checked PipelineSplit for pp > 1 (None for pp = 1) and the chunks each rank holds (virtual_stages:
    2 by default under the interleaved schedule, 1 otherwise). others: tp, zero and activation_checkpointing,
    which some schedules cannot run with."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    virtual = _virtual_stages(schedule, virtual_stages, pp, microbatches)
    _refuse_what_the_schedule_bypasses(schedule, others)
    if pp == 1:
        return None, 1
    if pp_split is None:
        raise ValueError(f"pp={pp} needs pp_split: the ordered names of the model's pieces (embedding, the blocks "
                         "container, final norm, head), or 'auto' for a Hugging Face model's own pipeline plan")
    split = (PipelineSplit.auto(model) if pp_split == "auto" else
             pp_split if isinstance(pp_split, PipelineSplit) else PipelineSplit(list(pp_split)))
    ties = cross_stage_ties(model, split, pp)  # checks the split first
    if ties:
        raise ValueError(f"{ties[0]} are one tied weight on different pipeline stages (the embedding on the first, "
                         "the head on the last); untie them (e.g. tie_word_embeddings=False) to pipeline this model")
    at = check_split(model, split, pp)
    blocks = len(model.get_submodule(split.pieces[at]))
    if virtual > 1 and blocks % (pp * virtual):
        raise ValueError(f"schedule='interleaved' cuts the {blocks} blocks of {split.pieces[at]} into pp x "
                         f"virtual_stages = {pp} x {virtual} equal chunks, which does not divide them; choose "
                         "virtual_stages so that it does")
    check_pieces(model, split, at)  # the pieces must compute what the model's forward does
    return split, virtual


def _virtual_stages(schedule: str, virtual_stages: int | None, pp: int, microbatches: int) -> int:
    """Chunks per rank: interleaved's (2 or more, default 2), else 1; ValueError saying what does not fit."""
    if schedule != "interleaved":
        if virtual_stages not in (None, 1):
            raise ValueError(f"virtual_stages={virtual_stages!r} is for schedule='interleaved', not {schedule!r}")
        return 1
    virtual = 2 if virtual_stages is None else virtual_stages
    if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 2:
        raise ValueError(f"schedule='interleaved' needs virtual_stages of 2 or more, got {virtual_stages!r}")
    if pp < 2:
        raise ValueError("schedule='interleaved' goes round the pipeline's ranks: give pp=2 or more")
    if microbatches % pp:
        raise ValueError(f"schedule='interleaved' runs micro-batches in groups of pp={pp}: microbatches="
                         f"{microbatches} must be a multiple of it")
    return virtual


def _refuse_what_the_schedule_bypasses(schedule: str, others: dict) -> None:
    tp, zero, recompute = others["tp"], others["zero"], others["activation_checkpointing"]
    if schedule == "zero-bubble" and (tp > 1 or zero >= 2 or recompute != "none"):
        raise ValueError(f"schedule='zero-bubble' with tp={tp}, zero={zero}, activation_checkpointing={recompute!r}: "
                         "its weight gradients are computed after the backward from each layer's noted output, "
                         "which a split layer, a sharded gradient or a recomputed layer changes; use "
                         "schedule='1f1b' with them")
    if schedule == "interleaved" and (tp > 1 or zero >= 2):
        raise ValueError(f"schedule='interleaved' with tp={tp}, zero={zero}: not combined yet (ZeRO-2/3 gather and "
                         "reduce each unit around the model's own forward and backward, which a chunk's bypasses); "
                         "use schedule='1f1b', or zero=0 or 1")

