"""What the `--parallel pipeline` tests share: torchrun launches of dmap on CPU (gloo, one thread per rank), plans made
in this process, and the "one process" reference run in this process too (one torch thread, as each rank has: the
same bytes), so that only the launches under test pay for a process's imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import run_dmap

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from launch_output import json_results  # noqa: E402,F401 - the benchmarks' reader of a launch's --json results

PROMPTS = ["a red fox", "a blue bird", "a green tree", "a grey cat"]


def launch_env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def dmap_inline(*args, cwd: Path) -> str:
    """dmap in this process with one torch thread (the ranks' OMP_NUM_THREADS=1), the thread count restored after;
    asserts exit 0 and returns stdout."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code, out, err = run_dmap(*args, cwd=cwd)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, out[-3000:] + err[-3000:]
    return out


def torchrun(ranks: int, *args, cwd: Path, wait: bool = True, **env):
    """`dmap *args` on `ranks` torchrun ranks: its output (asserting exit 0), or the running launch (wait=False)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "dm_cli", *map(str, args)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=launch_env(**env), cwd=cwd, start_new_session=True)
    if not wait:
        return proc
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-6000:]
    return output


def pipeline_plan(root: Path, model: Path, ranks: int, name: str, *extra) -> Path:
    """A `--parallel pipeline` plan of `model` over `ranks` 1 GB GPUs at 64x64, written to root/name."""
    devices = ",".join(f"{r}=1GB" for r in range(ranks))
    dmap_inline("plan", model, "--max-memory", devices, "--world-size", ranks, "--parallel", "pipeline", "--height", 64,
                "--width", 64, *extra, "-o", root / name, cwd=root)
    return root / name


def same_files(a: Path, b: Path, names) -> None:
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


