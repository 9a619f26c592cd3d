"""Measurements run from the command line (`minitrain bench ...`)."""
