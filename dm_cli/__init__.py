"""dmap: plan, shard and run big diffusion models across GPUs, CPU and disk."""

__version__ = "0.1.0"
