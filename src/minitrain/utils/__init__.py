"""Leaf helpers: progress bars."""
