"""Shared output helpers: JSON on stdout, human output through the Rich renderer."""

from __future__ import annotations

import os
import sys
import textwrap

from dm_cli.io.strict_json import json_text


def print_json(data) -> None:
    """With --json, stdout carries only this document: strict JSON (a NaN or an infinity is dmap's bug, refused)."""
    sys.stdout.write(json_text(data, indent=2) + "\n")
    sys.stdout.flush()


def say(message: str, stream=None) -> None:
    """One message for people (stdout unless `stream`). On a terminal it is wrapped at spaces to the terminal's
    width, so that the terminal does not cut a word in two; in a pipe or a log it stays one line. Never for a
    command to paste (a `Next:` hint): a line break inside it would run half of it."""
    stream = stream or sys.stdout
    if stream.isatty():
        try:
            width = int(os.environ.get("COLUMNS", "")) or os.get_terminal_size(stream.fileno()).columns
        except (ValueError, OSError):
            width = 80

        def fill(line: str) -> str:
            indent = line[:len(line) - len(line.lstrip(" "))]
            return textwrap.fill(line, max(width, 20), subsequent_indent=indent, break_long_words=False,
                                 break_on_hyphens=False) or line

        message = "\n".join(fill(line) for line in message.split("\n"))
    print(message, file=stream)
