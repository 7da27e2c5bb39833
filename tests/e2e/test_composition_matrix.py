"""The composition matrix of docs/commands.md ("What composes"): every ✔ cell names a test that exists, every
refusal cell quotes a sentence dmap's source gives word for word (a changed refusal fails here until the matrix
follows), and the table has the layouts and features issue 40 asks for."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = ["one process resident", "split across GPUs", "offload", "overlapped offload", "queue on ranks", "cfg",
           "context", "cfg+context", "pipeline", "serve"]
FEATURES = ["fp8", "int8", "GGUF", "LoRA fused", "LoRA unfused", "fbc", "taylorseer", "magcache",
            "Wan 2.2's two experts", "input images", "tiled decode"]
PROVEN = re.compile(r"✔ (test_\w+\.py)::(test_\w+)$")
REFUSED = re.compile(r'✘ (fact|not yet): "([^"]{20,})"$')


def _matrix() -> dict[tuple[str, str], str]:
    """(layout, feature) -> cell, from the table under "## What composes"."""
    text = (REPO / "docs" / "commands.md").read_text()
    section = text.split("## What composes", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    header, body = rows[0], rows[2:]
    assert header == ["layout", *FEATURES]
    assert [row[0] for row in body] == LAYOUTS
    assert all(len(row) == len(header) for row in body)
    return {(row[0], feature): cell for row in body for feature, cell in zip(FEATURES, row[1:])}


def _source_strings() -> list[str]:
    """Every string dm_cli's code writes, adjacent literals joined and an f-string's fields as {}."""
    strings = []
    for path in (REPO / "dm_cli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                strings.append("".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(node.value)
    return strings


def _defined_tests(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_cell_is_a_test_a_refusal_or_says_untested():
    cells = _matrix()
    assert len(cells) == len(LAYOUTS) * len(FEATURES)
    unread = {key: cell for key, cell in cells.items()
              if cell != "untested" and not PROVEN.match(cell) and not REFUSED.match(cell)}
    assert not unread, unread


def test_every_proven_cell_names_a_test_that_exists():
    missing = []
    for key, cell in _matrix().items():
        found = PROVEN.match(cell)
        if found:
            path = next((REPO / "tests").rglob(found[1]), None)  # the tests' folders mirror the package's
            if path is None or found[2] not in _defined_tests(path):
                missing.append((key, cell))
    assert not missing, missing


def test_every_refusal_is_the_sentence_dmap_gives():
    strings = _source_strings()
    changed = [(key, found[2]) for key, cell in _matrix().items()
               if (found := REFUSED.match(cell)) and not any(found[2] in s for s in strings)]
    assert not changed, changed


@pytest.mark.parametrize("layout,feature", [("cfg", "taylorseer"), ("context", "fbc"), ("context", "magcache"),
                                            ("serve", "taylorseer")])
def test_the_cells_issue_40_turned_are_proven(layout, feature):
    assert PROVEN.match(_matrix()[layout, feature])
