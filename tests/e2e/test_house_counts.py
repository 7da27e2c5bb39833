"""Issue 56's measures of the house stay where the redesign left them: no mode or compile word compared as a raw
string outside the boundary (the enums of dm_cli.planning.modes inside), and imports of dm_cli's own modules at the
top of their files but for the three with a reason (scripts/house_counts.py counts them)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import house_counts  # noqa: E402

# each with its reason beside it (tests/e2e/test_lazy_imports.py checks the reason is there)
FUNCTION_IMPORTS = {"dm_cli/cli/inspect.py", "dm_cli/run/hooks/compile.py", "dm_cli/run/hooks/component_hooks.py"}


def _counts() -> tuple[list, list, set]:
    words, compile_words, imports = [], [], set()
    for path in sorted((REPO / "dm_cli").rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(REPO))
        words += [f"{where}:{node.lineno}" for node in house_counts.raw_mode_words(tree)]
        compile_words += [f"{where}:{node.lineno}" for node in house_counts.raw_compile_words(tree)]
        imports |= {where for _ in house_counts.function_imports(tree)}
    return words, compile_words, imports


def test_no_raw_mode_word_and_imports_at_the_top():
    words, compile_words, imports = _counts()
    assert words == [] and compile_words == []
    assert imports <= FUNCTION_IMPORTS


def test_the_counter_sees_what_it_counts():
    """The counts above can fail: a raw word, a compile word and an import inside a function are each counted."""
    tree = ast.parse("def f(plan, mode):\n"
                     "    from dm_cli.planning import make\n"
                     "    if plan.layout == 'pipeline' or mode != 'resident':\n"
                     "        return make\n"
                     "    return mode == 'regional'\n")
    assert len(house_counts.raw_mode_words(tree)) == 2
    assert len(house_counts.raw_compile_words(tree)) == 1
    assert len(house_counts.function_imports(tree)) == 1
