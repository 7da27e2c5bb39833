"""The version of dmap: its own module, so that any layer (the cache keys, image metadata) can read it."""

__version__ = "0.1.0"
