"""dmap's on-disk cache (`$DMAP_CACHE_DIR`, else `$XDG_CACHE_HOME/dmap`, else `~/.cache/dmap`).

Skeletons, meta traces, split-check verdicts and the demo pipeline are pure functions of configs,
inputs, library versions and the dmap code that computes them: caching them keeps a second `inspect`
or `plan` torch-free and fast. Every key includes what produced the entry (`producer()`: dmap's
version and a digest of its code), so a changed dmap never reads an entry an older one wrote. A
cache entry that cannot be read is rebuilt and one that cannot be written only costs time, never an
error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata as importlib_metadata
from pathlib import Path

from dm_cli import version  # the module: tests replace its __version__
from dm_cli.errors import CheckpointError
from dm_cli.io.checkpoint import read_json_object
from dm_cli.io.strict_json import json_text

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# Subpackages that only talk to people (options, tables): they never compute a cached entry.
NOT_PRODUCERS = ("cli", "render")


def cache_dir() -> Path:
    if os.environ.get("DMAP_CACHE_DIR"):
        return Path(os.environ["DMAP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dmap"


@lru_cache(maxsize=1)
def library_versions() -> str:
    """Versions that change what a meta build or trace gives (read without importing them, once a process)."""
    versions = []
    for package in ("torch", "diffusers", "transformers"):
        try:
            versions.append(f"{package}={importlib_metadata.version(package)}")
        except importlib_metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    return ";".join(versions)


@lru_cache(maxsize=4)
def code_digest(package_dir: Path) -> str:
    """sha256 of every computing module of the package (all `.py` files outside cli/ and render/).

    Read once per process (about 1 ms): what computes an entry is this code, whichever module a
    refactor moves it to.
    """
    digest = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir)
        if relative.parts[0] in NOT_PRODUCERS or "__pycache__" in relative.parts:
            continue
        digest.update(relative.as_posix().encode() + b"\0")
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(b"unreadable")
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def producer() -> str:
    """What produces a cache entry: dmap's version and a digest of its code."""
    return f"dmap {version.__version__} code {code_digest(PACKAGE_DIR)}"


def cache_key(parts: dict) -> str:
    """A stable key for JSON-able `parts` plus the library versions and the producing dmap code."""
    blob = json.dumps({**parts, "versions": library_versions(), "producer": producer()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cache_path(kind: str, key: str) -> Path:
    return cache_dir() / kind / f"{key}.json"


def read_cached(kind: str, key: str) -> dict | None:
    """The entry, or None when it is missing or damaged (not JSON, not an object): it is then rebuilt."""
    try:
        return read_json_object(cache_path(kind, key), "cache entry", 1 << 30)
    except CheckpointError:
        return None


def write_cached(kind: str, key: str, data: dict) -> None:
    """Write atomically (temp file + rename): a reader never sees half an entry."""
    path = cache_path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as handle:
            handle.write(json_text(data))
        os.replace(tmp, path)
    except OSError:
        pass


CACHE_KINDS = {
    "skeletons": "per-component sizes and module trees (inspect, plan)",
    "traces": "meta-device traces: execution order and activation peaks (plan)",
    "checks": "split-check verdicts per device map (plan)",
    "demo": "the random-weight demo pipeline (run without SOURCE)",
}


@dataclass
class CacheEntry:
    kind: str
    files: int
    bytes: int
    what: str


def cache_usage() -> list[CacheEntry]:
    """Files and bytes per kind of entry (folders the cache holds that dmap does not know are listed too)."""
    root = cache_dir()
    kinds = dict(CACHE_KINDS)
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.is_dir() and not child.is_symlink():
                kinds.setdefault(child.name, "")
    entries = []
    for kind, what in kinds.items():
        files = size = 0
        folder = root / kind
        if folder.is_dir() and not folder.is_symlink():
            for dirpath, _dirs, names in os.walk(folder):
                for name in names:
                    try:
                        size += os.lstat(os.path.join(dirpath, name)).st_size
                        files += 1
                    except OSError:
                        pass
        entries.append(CacheEntry(kind, files, size, what))
    return entries


def clear_cache(kinds: list[str] | None = None) -> int:
    """Delete the cache's entries (every kind, or these): they are rebuilt when needed. Returns bytes freed."""
    root = cache_dir()
    freed = 0
    for entry in cache_usage():
        if kinds and entry.kind not in kinds:
            continue
        folder = root / entry.kind
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
            freed += entry.bytes
    return freed
