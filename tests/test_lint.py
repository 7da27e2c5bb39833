"""The code's own rules, run by the test command so CI keeps them: ruff (pyflakes, pycodestyle, import
order, bugbear, comprehensions: pyproject's [tool.ruff]) and import-linter's layer contracts (the core never
imports the CLI or the renderers; Typer only in the CLI, Rich only in the renderers)."""

import subprocess
import sys
from pathlib import Path

import tomllib
from conftest import REPO

BIN = Path(sys.executable).parent


def test_ruff_finds_nothing():
    done = subprocess.run([BIN / "ruff", "check", "--no-cache", "dm_cli", "tests", "scripts"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_import_contracts_are_kept():
    done = subprocess.run([BIN / "lint-imports", "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr


def test_every_core_module_is_under_the_contracts():
    """A new module of dm_cli is core unless it lives in cli/ or render/: it must be listed, or the
    contracts would silently not cover it."""
    config = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    listed = set(config[0]["source_modules"])
    package = Path(REPO) / "dm_cli"
    modules = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[1:2] in (("cli",), ("render",), ("__main__",), ("__init__",)) or parts[1] == "presets":
            continue
        modules.add(".".join(parts[:2]))  # a subpackage (families) is listed as a whole
    assert modules <= listed, f"add to [tool.importlinter] core lists: {sorted(modules - listed)}"
