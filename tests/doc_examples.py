"""A Markdown page's shell examples run as written: every `dmap ...` (and `torchrun ... -m dm_cli ...`) line of its
```bash blocks, in order, in one temporary working folder shared by the whole page, so that an example may use what
an earlier one wrote (`dmap demo tiny-wan -o tiny-wan`, then `dmap run tiny-wan ...`). Used by test_readme.py
(README.md) and test_docs_commands.py (docs/commands.md).

- `dmap` lines run in-process through the console entry point (`conftest.run_dmap`, argv from `shlex.split`; `&&`
  chains run left to right) and must exit 0.
- `printf ... > FILE` lines run through bash: they write the small input files (a prompts file) the next example reads.
- `torchrun ... -m dm_cli ...` lines run as a process (`python -m torch.distributed.run`, what the `torchrun`
  script runs), always as slow tests.
- Figures: every "double-quoted" text in a line's trailing comment is a quote of what the command prints (`# prints
  "1.78x"`) and must appear in its output, whitespace aside (the tables wrap at the terminal's width).

Skipped, and only these, by a trailing comment on the line, which says to the reader why it cannot run as is:

- `# needs real weights`: the example runs or shards a full-size model (FLUX.1 [dev], Qwen-Image, Wan 2.2), or reads
  a community file or a model folder the reader has (`path/to/flux`, `flux1-dev.safetensors`). A test machine has
  neither the tens of GB of weights nor the network to fetch them (HF_HUB_OFFLINE is set for every test).
- `# needs a GPU`: the example places weights on GPUs without `--simulate` (or gives torchrun ranks GPUs), which
  `dmap run` refuses on a machine without them.
- `# needs your files`: the example reads a file of the reader's own (a LoRA, a queue file) that the page does not
  write.
- `# runs until Ctrl-C`: a server.

Every other line starting with something else (scripts/test, `source`, curl, a SLURM script) is not a command of
this CLI and is left out.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_dmap

SKIP_MARKS = ("# needs real weights", "# needs a GPU", "# needs your files", "# runs until Ctrl-C")
SHELL_STEPS = ("printf ",)
LAUNCHES = ("torchrun ",)


def block_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command line) for every line of every ```bash block, continuation lines joined."""
    found, block, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
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


def comment_of(line: str) -> str:
    """The line's trailing shell comment (from the first `#` outside quotes that starts a word), or ''."""
    for match in re.finditer(r"(?:^|\s)#", line):
        head = line[:match.start()]
        try:
            shlex.split(head)
        except ValueError:  # inside quotes
            continue
        return line[match.start():].strip()
    return ""


def quoted_figures(line: str) -> list[str]:
    """The "double-quoted" texts of the line's comment: what the command prints."""
    return re.findall(r'"([^"]+)"', comment_of(line))


def examples(text: str, page: str, slow: tuple[str, ...] = ()) -> list:
    """pytest params (line number, line) for each line to run: skipped by a SKIP_MARKS comment, marked slow when
    it starts with one of `slow` (or is a torchrun launch)."""
    params = []
    for number, line in block_lines(text):
        if not line.startswith(("dmap ", *SHELL_STEPS, *LAUNCHES)):
            continue
        comment = comment_of(line)
        skip = next((mark for mark in SKIP_MARKS if mark in comment), None)
        marks = [pytest.mark.skip(reason=f"{page} line {number}: {skip.removeprefix('# ')}")] if skip else []
        if not skip and (line.startswith(LAUNCHES) or line.startswith(slow)):
            marks.append(pytest.mark.slow)
        params.append(pytest.param(number, line, id=f"L{number}", marks=marks))
    return params


def normalised(text: str) -> str:
    return " ".join(text.split())


def run_example(number: int, line: str, workdir: Path, page: str) -> None:
    """Run one line in `workdir`; assert it exits 0 and prints the figures its comment quotes."""
    where = f"{page} line {number}"
    if line.startswith(SHELL_STEPS):
        done = subprocess.run(["bash", "-c", line], cwd=workdir, capture_output=True, text=True)
        assert done.returncode == 0, f"{where}: {line}\n{done.stderr}"
        return
    tokens = shlex.split(line, comments=True)
    if line.startswith(LAUNCHES):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *tokens[1:]], cwd=workdir,
                              capture_output=True, text=True, env=dict(os.environ))
        code, out, err = done.returncode, done.stdout, done.stderr
        assert code == 0, f"{where} exits {code}: {line}\n{err[-3000:]}{out[-2000:]}"
    else:
        chain, current = [], []
        for token in tokens:
            if token == "&&":
                chain.append(current)
                current = []
            else:
                current.append(token)
        chain.append(current)
        for argv in chain:
            assert argv[0] == "dmap", f"{where}: only dmap commands are chained: {line}"
            code, out, err = run_dmap(*argv[1:], cwd=workdir)
            assert code == 0, f"{where} exits {code}: {shlex.join(argv)}\n{err}{out[-2000:]}"
    printed = normalised(out + "\n" + err)
    for figure in quoted_figures(line):
        assert normalised(figure) in printed, f"{where} quotes \"{figure}\", which {line!r} does not print:\n{out}{err}"
