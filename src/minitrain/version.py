"""The package's version, in a module of its own: what run files, exports and --version record, importable from any
layer without loading the public API."""

__version__ = "0.1.0"
