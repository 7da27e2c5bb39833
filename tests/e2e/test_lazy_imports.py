"""Imports inside functions (issue 39): only where they keep start-up light (torch and the other heavy libraries,
optional ones) or are looked up per call, each with its reason in a comment, and none repeating an import its
module already has. (That `dmap --help` loads none of the heavy libraries: tests/model/test_inspect.py.)"""

import ast
import io
import tokenize
from pathlib import Path

from conftest import REPO


def _bindings(node) -> set:
    """What an import statement binds, as (module, name, alias) ((module, None, alias) for `import module`)."""
    if isinstance(node, ast.Import):
        return {(alias.name, None, alias.asname) for alias in node.names}
    return {("." * node.level + (node.module or ""), alias.name, alias.asname) for alias in node.names}


def _header_end(function) -> int:
    """The last line of a def's signature: a comment there is about the def, not an import below it."""
    ends = [function.lineno] + [node.end_lineno for node in ast.walk(function.args) if hasattr(node, "end_lineno")]
    return max(ends + ([function.returns.end_lineno] if function.returns else []))


def function_imports_without_reason(root: Path) -> dict[str, list[str]]:
    """{"repeats": [...], "unexplained": [...]}, each "path:line import": an import inside a function that the module
    already makes at its top, or one with no comment on its line(s), nor on the line directly above its block of
    imports (inside the function)."""
    found = {"repeats": [], "unexplained": []}
    for path in sorted((root / "dm_cli").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        commented = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(text).readline)
                     if token.type == tokenize.COMMENT}
        tree = ast.parse(text)
        top = set().union(*(_bindings(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                shown = f"{name}:{node.lineno} {lines[node.lineno - 1].strip()}"
                if _bindings(node) & top:
                    found["repeats"].append(shown)
                first = node.lineno - 1  # the block: the imports directly above this one
                while first > _header_end(function) and lines[first - 1].lstrip().startswith(("import ", "from ")):
                    first -= 1
                own = set(range(node.lineno, node.end_lineno + 1))
                if not own & commented and not (first > _header_end(function) and first in commented):
                    found["unexplained"].append(shown)
    return {kind: sorted(set(shown)) for kind, shown in found.items()}


def test_every_import_inside_a_function_has_a_reason_and_repeats_nothing():
    found = function_imports_without_reason(Path(REPO))
    assert not found["repeats"], "already imported at the module's top:\n" + "\n".join(found["repeats"])
    assert not found["unexplained"], ("an import inside a function needs its reason in a comment (on its line, or "
                                      "above its block), or to move to the top:\n" + "\n".join(found["unexplained"]))


def test_the_walk_finds_repeats_and_imports_without_a_reason(tmp_path):
    package = tmp_path / "dm_cli"
    package.mkdir()
    (package / "m.py").write_text(
        "import os\n\n\n"
        "def repeats():\n    import os\n\n    return os\n\n\n"
        "def bare():\n    import json\n    return json\n\n\n"
        "def on_its_line():\n    import torch  # lazy: torch\n    return torch\n\n\n"
        "def above_the_block():\n    # lazy: torch and numpy\n    import numpy\n    import torch\n\n    return torch, numpy\n\n\n"
        "def after_code():  # a comment on the def is not a reason\n    import numpy\n    return numpy\n")
    found = function_imports_without_reason(tmp_path)
    assert found == {"repeats": ["dm_cli/m.py:5 import os"],
                     "unexplained": ["dm_cli/m.py:11 import json", "dm_cli/m.py:29 import numpy", "dm_cli/m.py:5 import os"]}
