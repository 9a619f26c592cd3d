"""MiniGPT: model.py imports nothing distributed; plan.py says how to split it; MINIGPT is the two as one spec."""
from torch import nn

from ..spec import ModelSpec
from .model import MiniGPT
from .moe import MoEMLP
from .plan import MINIGPT_PLAN


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    """The model's mixture-of-experts layers in module order (none in a dense MiniGPT). Found among all its modules,
    not only the blocks' MLPs: a wrapper (compiled or recomputed blocks) may stand between."""
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


MINIGPT = ModelSpec("minigpt", MiniGPT, MINIGPT_PLAN, expert_layers=moe_layers)

__all__ = ["MINIGPT", "MINIGPT_PLAN", "MiniGPT"]
