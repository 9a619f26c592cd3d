"""MiniGPT: model.py imports nothing distributed; plan.py says how to split it; MINIGPT is the two as one spec."""
from ..spec import ModelSpec
from .model import MiniGPT
from .plan import MINIGPT_PLAN

MINIGPT = ModelSpec("minigpt", MiniGPT, MINIGPT_PLAN)

__all__ = ["MINIGPT", "MINIGPT_PLAN", "MiniGPT"]
