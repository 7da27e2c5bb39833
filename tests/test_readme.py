"""The README's examples work as written: every `dmap ...` line of its ```bash blocks, in order.

Each line runs in-process through the console entry point (`dm_cli.cli.main`, argv from `shlex.split`;
`&&` chains run left to right) in one temporary working folder shared by the whole README, so an example
may use what an earlier one wrote (`dmap demo tiny-wan -o tiny-wan`, then `dmap run tiny-wan ...`), and
must exit 0. Besides `dmap` lines, only `printf ... > FILE` lines run (through bash, in that folder): they
write the small input files (a prompts file) that the next example reads.

Skipped, and only these, by a trailing comment on the README line:

- `# needs real weights`: the example runs or shards a full-size model (FLUX.1 [dev], Qwen-Image, Wan 2.2)
  from the local Hugging Face cache. A test machine has neither the tens of GB of weights nor the network
  to fetch them (HF_HUB_OFFLINE is set for every test), and random weights at that size would take
  minutes and tens of GB of RAM.
- `# needs a GPU`: the example places weights on GPUs without `--simulate`, which `dmap run` refuses on a
  machine without them.

Lines that do not start with `dmap` (scripts/test and scripts/demo, which set up the virtual environment,
`source .venv/bin/activate`, torchrun launches) are not commands of this CLI and are left out.

The README is a newcomer's page (at most 300 lines: `test_the_readme_stays_short`); the reference lives in
docs/, and every relative link of README.md, CHANGELOG.md and docs/*.md must point at a file that exists, and at a
heading of it when the link names one (`test_relative_links_resolve`). Keep the examples few and quick:
every line here runs on each test run, with a cold dmap cache.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, run_dmap

README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 300
SKIP_MARKS = ("# needs real weights", "# needs a GPU")
SHELL_STEPS = ("printf ",)


def readme_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command line) for every line of every ```bash block, continuation lines joined."""
    found, lines, block, pending, start = [], text.splitlines(), False, "", 0
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            block = line.strip() == "```bash" if not block else False
            continue
        if not block:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        found.append((start, (pending + line).strip()))
        pending = ""
    return found


def commands(text: str):
    """pytest params: (line number, the README line, [argv, ...]) for each dmap or shell-step line."""
    params = []
    for number, line in readme_lines(text):
        if not line.startswith(("dmap ", *SHELL_STEPS)):
            continue
        skip = next((mark for mark in SKIP_MARKS if mark in line), None)
        marks = [pytest.mark.skip(reason=f"README line {number}: {skip.removeprefix('# ')}")] if skip else []
        params.append(pytest.param(number, line, id=f"L{number}", marks=marks))
    return params


COMMANDS = commands(README.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


def test_the_readme_has_runnable_examples():
    assert len([p for p in COMMANDS if not p.marks]) >= 12
    assert len([p for p in COMMANDS if p.marks]) <= 4  # the skipped lines stay few


@pytest.mark.parametrize("number, line", COMMANDS)
def test_readme_example(number, line, workdir):
    if line.startswith(SHELL_STEPS):
        done = subprocess.run(["bash", "-c", line], cwd=workdir, capture_output=True, text=True)
        assert done.returncode == 0, f"README line {number}: {line}\n{done.stderr}"
        return
    tokens = shlex.split(line, comments=True)
    chain, current = [], []
    for token in tokens:
        if token == "&&":
            chain.append(current)
            current = []
        else:
            current.append(token)
    chain.append(current)
    for argv in chain:
        assert argv[0] == "dmap", f"README line {number}: only dmap commands are chained: {line}"
        code, out, err = run_dmap(*argv[1:], cwd=workdir)
        assert code == 0, f"README line {number} exits {code}: {shlex.join(argv)}\n{err}{out[-2000:]}"


def test_skip_marks_are_recognised():
    params = commands("```bash\ndmap run x -p a   # needs real weights\ndmap inspect flux\nscripts/test\n```\n")
    assert [(p.values[0], bool(p.marks)) for p in params] == [(2, True), (3, False)]
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
