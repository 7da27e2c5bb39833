"""dmap's on-disk cache (`$DMAP_CACHE_DIR`, else `$XDG_CACHE_HOME/dmap`, else `~/.cache/dmap`).

Skeletons, meta traces and split-check verdicts are pure functions of configs, inputs and library
versions: caching them keeps a second `inspect` or `plan` torch-free and fast. A cache entry that
cannot be read is rebuilt and one that cannot be written only costs time, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib import metadata as importlib_metadata
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("DMAP_CACHE_DIR"):
        return Path(os.environ["DMAP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dmap"


def library_versions() -> str:
    """Versions that change what a meta build or trace gives (read without importing them)."""
    versions = []
    for package in ("torch", "diffusers", "transformers"):
        try:
            versions.append(f"{package}={importlib_metadata.version(package)}")
        except importlib_metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    return ";".join(versions)


def cache_key(parts: dict) -> str:
    """A stable key for JSON-able `parts` plus the library versions."""
    blob = json.dumps({**parts, "versions": library_versions()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cache_path(kind: str, key: str) -> Path:
    return cache_dir() / kind / f"{key}.json"


def read_cached(kind: str, key: str) -> dict | None:
    """The entry, or None when it is missing or damaged (not JSON, not an object): it is then rebuilt."""
    path = cache_path(kind, key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def write_cached(kind: str, key: str, data: dict) -> None:
    """Write atomically (temp file + rename): a reader never sees half an entry."""
    path = cache_path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle)
        os.replace(tmp, path)
    except OSError:
        pass
