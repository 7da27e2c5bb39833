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


def test_a_cycle_between_a_package_and_a_module_inside_it_breaks_a_contract(tmp_path):
    """dm_cli.families imported dm_cli.families.calls, which imported family_for back inside a function: the
    `acyclic_packages` contract (scripts/import_contracts.py) is broken by that shape, and kept without it."""
    import os

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.calls import spec\n\ndef family_for():\n    return 1\n")
    (package / "calls.py").write_text("def spec():\n    from pkg import family_for\n\n    return family_for()\n")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_package = pkg\ncontract_types =\n"
        "    acyclic_packages: scripts.import_contracts.AcyclicPackagesContract\n\n"
        "[importlinter:contract:one]\nname = no package cycles\ntype = acyclic_packages\nancestors =\n    pkg\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    lint = lambda: subprocess.run([BIN / "lint-imports", "--no-cache"], cwd=tmp_path, env=env,  # noqa: E731
                                  capture_output=True, text=True)
    done = lint()
    assert done.returncode == 1 and "pkg and pkg.calls import each other" in done.stdout, done.stdout + done.stderr
    (package / "calls.py").write_text("def spec():\n    return 1\n")
    done = lint()
    assert done.returncode == 0, done.stdout + done.stderr
