"""MiniGPT: model.py imports nothing distributed; plan.py says how to split it."""
