"""JSON as dmap writes it, everywhere: plan files, `--json` on stdout, queue manifests, served responses, the cache
and device profiles. Strict: Python's json writes NaN and Infinity, which are not JSON (every other parser refuses
them, and a plan carrying them was refused by dmap itself). dmap's figures are bounded where they are made (a
device profile's rates, planning/time/profiles.py), so a non-finite number here is dmap's bug: it is refused loudly,
naming where it is, never written."""

from __future__ import annotations

import json
import math


class NonFiniteNumber(RuntimeError):
    """A NaN or an infinity on its way into JSON: a bug (the figure should have been bounded where it was made)."""


def json_text(data, *, indent: int | None = None, sort_keys: bool = False, ensure_ascii: bool = True,
              separators: tuple[str, str] | None = None) -> str:
    """`data` as strict JSON text (json.dumps with allow_nan=False); NonFiniteNumber naming the first key path
    holding a NaN or an infinity."""
    try:
        return json.dumps(data, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii, separators=separators,
                          allow_nan=False)
    except ValueError:
        where = non_finite_path(data)
        if where is None:
            raise
        raise NonFiniteNumber(f"dmap was about to write a non-finite number ({where[1]}) at {where[0]} into JSON, "
                              "which it never should") from None


def non_finite_path(data, path: str = "$") -> tuple[str, float] | None:
    """(key path such as `$.predicted_time.step_s`, the value) of the first NaN or infinity in `data`, or None."""
    stack = [(path, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where, value
        if isinstance(value, dict):
            stack.extend((f"{where}.{key}", item) for key, item in reversed(list(value.items())))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None
