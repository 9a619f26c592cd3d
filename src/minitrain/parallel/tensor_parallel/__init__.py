"""Tensor parallel (Megatron-LM): layers split across ranks (layers.py) and plans that say which module of a model
becomes which (plans.py)."""
