"""Leaf helpers: progress bars, batches made ahead."""
