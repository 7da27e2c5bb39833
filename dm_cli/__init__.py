"""dmap: plan, shard and run big diffusion models across GPUs, CPU and disk.

The Python API is `plan`, `load` and `dispatch` (the names in `__all__`; docs/commands.md, "Python API"):

    plan = dm_cli.plan("path/to/flux", max_memory="0=16GB,1=16GB")   # -> Plan
    with dm_cli.load("path/to/flux", plan) as pipe:                   # -> dm_cli.run.sessions.session.Session
        for out in pipe.generate(["a red fox", "a cat"], seed=0):
            out.image.save(f"{out.index}.png")
    dm_cli.dispatch(diffusers_pipe, plan)                             # place an existing pipeline

Nothing else in the package is promised to stay. Importing dm_cli imports no torch.
"""

from dm_cli import api
from dm_cli.version import __version__

__all__ = ["plan", "load", "dispatch", "__version__"]


def __getattr__(name: str):
    """The API on first use: `dmap --help` must not pay for it."""
    if name in ("plan", "load", "dispatch"):
        return getattr(api, name)
    raise AttributeError(f"module 'dm_cli' has no attribute '{name}'")
