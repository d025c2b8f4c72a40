"""The package version, in a module of its own: `diff-transformer --version` and setup.cfg read it without importing
torch or transformers."""

__version__ = "0.1.0"
