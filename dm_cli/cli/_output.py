"""Shared output helpers: JSON on stdout, human output through the Rich renderer."""

from __future__ import annotations

import json
import sys


def print_json(data) -> None:
    """With --json, stdout carries only this document."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()
