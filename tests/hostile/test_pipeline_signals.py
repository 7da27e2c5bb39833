"""Signals and rank counts on the `--parallel pipeline` path (issue 44 E): SIGINT to rank 0 mid-queue exits 130, the
rank stopping its threads before it leaves its process group (never `terminate called without
an active exception`, SIGABRT, at exit), and a pipeline plan under another number of ranks is refused on every rank.

The tiny denoiser computes in milliseconds, so a prompt thread is almost never inside torch when a rank exits. The
launch goes through a wrapper that gives each slice's call the compute of a real model's slice (matrix products in
torch's C++, half a second; once the signal is sent, 3 s from the call's start: longer than the rank takes to exit) and
marks when denoising has begun: a rank that leaves without waiting for its threads aborts (the thread returns from
torch into a finalising interpreter: exit -6, as issue 44 saw it twice in two tries). With the threads' wait reverted
to Thread.join, the SIGTERMed rank exited 0.7 s after the signal (load 12 on 2 cores) and aborted with 3 s as with 15."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_launch import launch_env, pipeline_plan
from test_queue_run import _rank_pid  # the torchrun worker with RANK=r, read from /proc

SLOW_SLICE = '''
import os, sys, time
import torch
from dm_cli.run.ranks import pipeline

forward = pipeline.SliceForward.__call__


def heavy(self, *args, **kwargs):
    marker = os.environ["DMAP_TEST_DENOISING"] + "-rank" + os.environ["RANK"]
    if not os.path.exists(marker):
        open(marker, "w").close()
    signalled = os.environ.get("DMAP_TEST_SIGNALLED", "")
    x, start, seconds = torch.randn(256, 256), time.monotonic(), 0.5
    while time.monotonic() < start + seconds:  # a real slice's compute: torch ops, the GIL released
        x = torch.tanh(x @ x)
        if signalled and os.path.exists(signalled):  # longer than a rank that does not wait takes to exit
            seconds = 3.0
    return forward(self, *args, **kwargs)


pipeline.SliceForward.__call__ = heavy
from dm_cli.cli import main

sys.argv[0] = "dmap"
main()
'''


def _env(**extra) -> dict:
    return launch_env(DMAP_DIST_TIMEOUT="60", **extra)


@pytest.fixture(scope="module")
def piped(tmp_path_factory):
    """tiny-flux and its 2-rank pipeline plan at 64x64; a queue of 4 prompts; the slow-slice launcher."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("pipeline-signals")
    model = write_random_pipeline(PRESETS_DIR / "tiny-flux", root / "tiny-flux", seed=0)
    plan = pipeline_plan(root, model, 2, "two.json")
    (root / "prompts.txt").write_text("a red fox\na blue bird\na green tree\na grey cat\n")
    (root / "slow_slice.py").write_text(SLOW_SLICE)
    return root, model, plan


def _launch(root: Path, ranks: int, *args, slow: bool = False, **env) -> subprocess.Popen:
    program = [str(root / "slow_slice.py")] if slow else ["-m", "dm_cli"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               *program, *map(str, args)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(**env),
                            cwd=root, start_new_session=True)


def _exit_codes(output: str) -> dict[int, int]:
    """Each failed rank's exit code, as torchrun reports it (a rank that exited 0 is not listed)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", output)
    return {int(rank): int(code) for rank, code in found}


def _signal_mid_denoise(piped, out: Path, rank: int, sig: int, tag: str) -> tuple[subprocess.Popen, str]:
    """A 2-rank pipeline queue; `sig` to `rank` once both ranks denoise; the launch's return code and output."""
    root, model, plan = piped
    marker, signalled = root / f"denoising-{tag}", root / f"signalled-{tag}"
    proc = _launch(root, 2, "run", model, "-d", plan, "--prompts", root / "prompts.txt", "--output", out,
                   "--steps", 2, slow=True, DMAP_TEST_DENOISING=str(marker), DMAP_TEST_SIGNALLED=str(signalled))
    deadline = time.time() + 600
    victim = None
    while victim is None or not all(Path(f"{marker}-rank{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-4000:]
        victim = victim or _rank_pid(proc.pid, rank)
        time.sleep(0.05)
    signalled.touch()
    os.kill(victim, sig)
    output, _ = proc.communicate(timeout=300)
    return proc, output


def _clean(output: str, out: Path) -> None:
    assert "terminate called" not in output and "SIGABRT" not in output and "core dumped" not in output, output[-4000:]
    assert "/dm_cli/" not in output, output[-4000:]  # no traceback of dmap's (torchrun prints its own)
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name or p.name.startswith(".")], sorted(out.iterdir())


def _sigint_rank_0(piped, tmp_path, tag: str) -> None:
    out = tmp_path / f"out-{tag}"
    proc, output = _signal_mid_denoise(piped, out, 0, signal.SIGINT, tag)
    codes = _exit_codes(output)
    assert codes.get(0) == 130, (codes, output[-4000:])
    # the other rank: stopped by torchrun's SIGTERM (-15, the moment rank 0 has exited); never -6
    assert codes.get(1, 0) in (0, 1, -15), (codes, output[-4000:])
    assert "[rank 0/2] Queue interrupted" in output and "nothing was left half-written" in output
    _clean(output, out)
    assert proc.returncode != 0


def test_sigint_to_rank_0_mid_queue_exits_130_without_an_abort(piped, tmp_path):
    _sigint_rank_0(piped, tmp_path, "int")


@pytest.mark.heavy
def test_sigterm_to_a_rank_mid_queue_exits_143_without_an_abort(piped, tmp_path):
    """SIGTERM (what torchrun sends every other rank when one ends) stops the last rank in order: exit 143, one
    sentence. It aborted every time: the main thread's join of a prompt thread, interrupted by the signal, marked
    the thread stopped while it still ran inside torch (see pipeline.RankThread)."""
    out = tmp_path / "out-term"
    proc, output = _signal_mid_denoise(piped, out, 1, signal.SIGTERM, "term")
    codes = _exit_codes(output)
    assert codes.get(1) == 143, (codes, output[-4000:])
    # rank 0: lost its peer (1, one sentence) or stopped by torchrun's SIGTERM in turn (143, or -15 before it began)
    assert codes.get(0, 0) in (0, 1, 143, -15), (codes, output[-4000:])
    assert "Error: Stopped by SIGTERM: what was written is complete" in output, output[-4000:]
    _clean(output, out)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_rank_that_lost_its_peer_says_so_and_exits_1_without_an_abort(piped, tmp_path):
    """Ranks started by hand (no torchrun to stop the survivor): rank 1 is killed mid-denoise; rank 0's prompt
    threads fail on the closed connection, it leaves its group in order and says so in one sentence, exit 1."""
    root, model, plan = piped
    marker, signalled, out = tmp_path / "denoising", tmp_path / "signalled", tmp_path / "out"
    port = _free_port()
    ranks = []
    for rank in (0, 1):
        env = _env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DMAP_TEST_DENOISING=str(marker),
                   DMAP_TEST_SIGNALLED=str(signalled))
        ranks.append(subprocess.Popen([sys.executable, str(root / "slow_slice.py"), "run", str(model), "-d", str(plan),
                                       "--prompts", str(root / "prompts.txt"), "--output", str(out), "--steps", "2"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root))
    try:
        deadline = time.time() + 600
        while not all(Path(f"{marker}-rank{r}").exists() for r in (0, 1)):
            assert all(p.poll() is None for p in ranks) and time.time() < deadline, \
                [p.communicate()[0][-3000:] for p in ranks if p.poll() is not None]
            time.sleep(0.05)
        signalled.touch()
        ranks[1].kill()
        output, _ = ranks[0].communicate(timeout=300)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert ranks[0].returncode == 1, (ranks[0].returncode, output[-4000:])
    lost = [line for line in output.splitlines() if "The pipeline lost" in line]
    assert len(lost) == 1 and lost[0].startswith("Error: The pipeline lost ") and "the same command resumes" in lost[0]
    assert "pair.cc" not in lost[0] and "/__w/" not in lost[0], lost  # gloo's source line is not the user's business
    _clean(output, out)


def test_a_pipeline_plan_under_another_rank_count_is_refused_once(piped):
    """A 2-rank pipeline plan under 3 ranks with --simulate ran as a 3-way queue: refused, exit 2, one sentence. Every
    rank refuses the same command: rank 0 says it, the others keep it to themselves until torchrun stops them (a
    rank still running after RANK_0_FIRST_S says it once, prefixed with its rank)."""
    root, model, plan = piped
    proc = _launch(root, 3, "run", model, "-d", plan, "--simulate", "--prompts", root / "prompts.txt", "--output",
                   root / "three")
    output, _ = proc.communicate(timeout=600)
    codes = _exit_codes(output)
    # a rank that refused exits 2; one that torchrun stopped once another had refused shows -15
    assert proc.returncode != 0 and 2 in codes.values() and set(codes.values()) <= {2, -15}, (codes, output[-4000:])
    refusals = [line for line in output.splitlines() if "but torchrun started 3" in line]
    sentence = re.compile(r"(\[rank [12]/3\] )?Error: The plan shares each step over 2 ranks [^\n]*but torchrun "
                          r"started 3: launch with --nproc-per-node 2, or give --parallel none\.")
    assert refusals and all(sentence.fullmatch(line) for line in refusals), refusals
    said_by = [line.split("]")[0] if line.startswith("[") else "rank 0" for line in refusals]
    assert len(said_by) == len(set(said_by)), refusals  # no rank says it twice
    if codes.get(0) == 2:  # rank 0 refused first (as it does unless it lags the others by RANK_0_FIRST_S): once
        assert len(refusals) == 1 and refusals[0].startswith("Error: "), output[-4000:]
    assert "/dm_cli/" not in output, output[-4000:]  # no traceback of dmap's (torchrun prints its own)
    assert not (root / "three").exists() or not list((root / "three").glob("*.png"))


@pytest.mark.heavy
@pytest.mark.slow
def test_a_finished_pipeline_queue_exits_0_without_an_abort(piped, tmp_path):
    root, model, plan = piped
    out = tmp_path / "done"
    proc = _launch(root, 2, "run", model, "-d", plan, "--prompts", root / "prompts.txt", "--output", out,
                   "--steps", 2, slow=True, DMAP_TEST_DENOISING=str(tmp_path / "denoising"))
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    assert "terminate called" not in output and len(list(out.glob("0000*.png"))) == 4


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_a_signal_while_joining_does_not_leave_a_prompt_thread_running():
    """The cause of the aborts: Python 3.11's `Thread.join(timeout)`, interrupted by a signal handler's exception,
    marks the thread it joins stopped while it still runs, and a wait on `is_alive()` returns at once. `join_all`
    waits on each RankThread's own event: it returns only once the work has really ended, signals or not."""
    from dm_cli.run.ranks.pipeline_links import RankThread, join_all

    ended = []
    thread = RankThread(lambda: (time.sleep(1.0), ended.append(True)), (), "dmap-test")

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        thread.start()
        signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)  # a signal every 0.2 s while join_all waits
        assert join_all([thread], timeout_s=30)
        assert ended == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
