"""The README's examples work as written: every `dmap ...` line of its ```bash blocks, in order.

How the lines are found, run and checked, and the trailing comments that skip one (`# needs real weights`,
`# needs a GPU`, ...), is tests/doc_examples.py, shared with docs/commands.md's test (test_docs_commands.py): every
line runs in-process in one temporary working folder shared by the whole README, must exit 0 and print the figures
its comment quotes; `printf ... > FILE` lines write the small input files the next example reads; the torchrun
launch on CPU ranks runs as a slow test.

The README is a newcomer's page (at most 300 lines: `test_the_readme_stays_short`); the reference lives in
docs/, and every relative link of README.md, CHANGELOG.md and docs/*.md must point at a file that exists, and at a
heading of it when the link names one (`test_relative_links_resolve`). Keep the examples few and quick:
every line here runs on each test run, with a cold dmap cache.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO
from doc_examples import examples, run_example

README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 300

COMMANDS = examples(README.read_text(encoding="utf-8"), "README")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


def test_the_readme_has_runnable_examples():
    assert len([p for p in COMMANDS if not p.marks]) >= 12
    assert len([p for p in COMMANDS if p.marks]) <= 6  # the skipped lines (and the one torchrun launch) stay few


@pytest.mark.parametrize("number, line", COMMANDS)
def test_readme_example(number, line, workdir):
    run_example(number, line, workdir, "README")


def test_skip_marks_are_recognised():
    params = examples("```bash\ndmap run x -p a   # needs real weights\ndmap inspect flux\nscripts/test\n"
                      "dmap run x -p '# needs a GPU'\ntorchrun -m dm_cli run -p a\n```\n", "page")
    assert [(p.values[0], [m.name for m in p.marks]) for p in params] == [
        (2, ["skip"]), (3, []), (5, []), (6, ["slow"])]  # a mark inside quotes is not a comment
    assert re.search(r"needs real weights", params[0].marks[0].kwargs["reason"])


def test_the_readme_stays_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move reference text to docs/"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def outside_code(text: str) -> list[str]:
    """The lines of a Markdown text that are not inside ``` fences."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return kept


def anchors(text: str) -> set[str]:
    """The heading anchors GitHub gives a Markdown text: lower case, punctuation dropped, spaces to
    hyphens, repeated anchors numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    for line in outside_code(text):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug)
        seen[slug] = 0 if count is None else count + 1
        if count is not None:
            seen[f"{slug}-{count + 1}"] = 0
    return set(seen)


def relative_links(path: Path) -> list[str]:
    return [target for line in outside_code(path.read_text(encoding="utf-8")) for target in LINK.findall(line)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked


def test_relative_links_resolve():
    docs = [README, REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
    assert len(docs) > 2, "docs/ holds the reference the README links to"
    broken = []
    for doc in docs:
        for target in relative_links(doc):
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_doc():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in relative_links(README)}
    missing = [doc.name for doc in sorted(DOCS.glob("*.md")) if doc.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_anchors_follow_github():
    text = "# A queue of prompts: `dmap run --prompts`\n## Plan JSON (`dmap-plan`, v1)\n```\n# not a heading\n```\n## x\n## x\n"
    assert anchors(text) == {"a-queue-of-prompts-dmap-run---prompts", "plan-json-dmap-plan-v1", "x", "x-1"}
