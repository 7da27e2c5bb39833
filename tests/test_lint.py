"""The code's own rules, run by the test command so CI keeps them: ruff (pyflakes, pycodestyle, import
order, bugbear, comprehensions: pyproject's [tool.ruff]) and import-linter's layer contracts (the core never
imports the CLI or the renderers; Typer only in the CLI, Rich only in the renderers), and no function over
80 lines."""

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


def test_the_layers_contract_places_every_module_and_counts_every_import():
    """The wings contract is exhaustive (a new module of dm_cli must be given a layer, or lint-imports fails)
    and TYPE_CHECKING imports are not left out: with imports inside functions, grimp reads them all."""
    settings = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in settings["contracts"] if c["type"] == "layers")
    assert layers["exhaustive"] is True and layers["containers"] == ["dm_cli"]
    assert not settings.get("exclude_type_checking_imports", False)
    assert any(c["type"] == "acyclic_siblings" and c["ancestors"] == ["dm_cli"] for c in settings["contracts"])
    placed = {name.strip() for layer in layers["layers"] for name in layer.split("|")}
    package = Path(REPO) / "dm_cli"
    children = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert children - placed - {"__init__", "__main__"} == set()


def test_no_function_is_longer_than_80_lines():
    import ast

    long = []
    for path in (Path(REPO) / "dm_cli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, long
