"""Two of issue 56's measures of the house, counted on the source (no import of dm_cli):

- raw mode words: comparisons (==, !=, in, not in) of an expression with a mode's word written as a string (a word of
  `dm_cli.planning.modes`' Strategy, Mode, Layout or Parallel other than "none", which is also a compile, LoRA and
  cache word) instead of its enum member; a source's kind ("pipeline": a folder) and a size ("auto") are other
  vocabularies and not counted;
- raw compile words: the same comparisons with a word of `dm_cli.planning.modes.CompileMode` ("regional", "full";
  "auto" is counted as a mode word above); "none" and "" count only where the compared expression or the function
  around it speaks of compiling (elsewhere "none" is a LoRA's, a cache's or --parallel's word);
- function-level imports: `import dm_cli...` or `from dm_cli... import` (or a relative import) inside a function.

Usage: python scripts/house_counts.py [ROOT=dm_cli] [-v]: the two totals; -v lists each place.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

MODE_WORDS = {"auto", "sequential", "balanced", "balanced_low_0", "resident", "staged", "split", "cfg", "context",
              "cfg+context", "pipeline"}
COMPILE_WORDS = {"regional", "full"}
COMPILE_NONE = {"none", ""}
COMPILING = re.compile(r"compil")
OTHER_VOCABULARIES = re.compile(r"source\.kind|result\.kind|\bsize\b")


def _strings(node: ast.AST) -> list[str] | None:
    """The str constants `node` is (one, or a tuple/list/set of them and None), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        found: list[str] = []
        for element in node.elts:
            if isinstance(element, ast.Constant) and element.value is None:
                continue
            inner = _strings(element)
            if inner is None:
                return None
            found += inner
        return found
    return None


def raw_mode_words(tree: ast.AST) -> list[ast.Compare]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        words = [w for side in sides for w in (_strings(side) or [])]
        others = [ast.unparse(side) for side in sides if _strings(side) is None]
        if MODE_WORDS & set(words) and not any(OTHER_VOCABULARIES.search(other) for other in others):
            found.append(node)
    return found


def raw_compile_words(tree: ast.AST) -> list[ast.Compare]:
    found = []
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for function in [tree, *functions]:
        for node in ast.walk(function):
            if not isinstance(node, ast.Compare) or id(node) in {id(f) for f in found}:
                continue
            sides = [node.left, *node.comparators]
            words = {w for side in sides for w in (_strings(side) or [])}
            others = " ".join(ast.unparse(side) for side in sides if _strings(side) is None)
            about_compiling = COMPILING.search(others) or COMPILING.search(getattr(function, "name", ""))
            if COMPILE_WORDS & words or (COMPILE_NONE & words and about_compiling):
                found.append(node)
    return found


def function_imports(tree: ast.AST) -> list[ast.stmt]:
    found: dict[int, ast.stmt] = {}
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            own = (isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("dm_cli"))
                   or isinstance(node, ast.Import) and any(a.name.startswith("dm_cli") for a in node.names))
            if own:
                found[id(node)] = node
    return list(found.values())


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    verbose = "-v" in sys.argv
    words = compile_words = imports = 0
    for path in sorted(Path(args[0] if args else "dm_cli").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for kind, nodes in (("mode word", raw_mode_words(tree)), ("compile word", raw_compile_words(tree)),
                            ("function import", function_imports(tree))):
            for node in nodes:
                if verbose:
                    print(f"{path}:{node.lineno}: {kind}: {ast.unparse(node)[:100]}")
            if kind == "mode word":
                words += len(nodes)
            elif kind == "compile word":
                compile_words += len(nodes)
            else:
                imports += len(nodes)
    print(f"raw mode-word comparisons: {words}")
    print(f"raw compile-word comparisons: {compile_words}")
    print(f"function-level imports of dm_cli modules: {imports}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
