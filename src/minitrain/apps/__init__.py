"""The commands: one module per command (cli.py parses and dispatches)."""
