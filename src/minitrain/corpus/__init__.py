"""Corpora on disk: prepared token files, the tokenizer, `minitrain data prepare` (data.py holds the loaders and sharding)."""
