import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "dm_cli" / "presets"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Each test session gets its own skeleton cache; tests never touch the user's."""
    cache = os.environ.get("DMAP_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "dmap-cache")
    monkeypatch.setenv("DMAP_CACHE_DIR", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run_dmap(*args, env=None, cwd=None):
    """Run the real CLI in a subprocess: exit code, stdout, stderr."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "dm_cli", *map(str, args)], capture_output=True, text=True,
                          env=full_env, cwd=cwd)
    return proc.returncode, proc.stdout, proc.stderr


def load_json(path):
    return json.loads(Path(path).read_text())


def dmap_main(capsys, *args):
    """Run the CLI in this process (fast): exit code, stdout, stderr."""
    from dm_cli.cli import main

    capsys.readouterr()
    try:
        main([str(a) for a in args])
    except SystemExit as done:
        code = done.code or 0
    else:
        code = 0
    out = capsys.readouterr()
    return code, out.out, out.err
