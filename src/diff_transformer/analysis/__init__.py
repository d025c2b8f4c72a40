"""Attention analysis: the two softmax maps, λ and the differential map of every head (`maps`), metrics on them, and
figures (`plotting`, needs matplotlib: the `[analysis]` extra)."""

from .maps import *  # noqa: F403  (the public names of maps, listed once in maps.__all__)
from .maps import __all__  # noqa: F401
