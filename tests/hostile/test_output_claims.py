"""Hostile input, round 3, D (issue 44): two runs must never take the same output. Two `dmap run -o same.png`
started together both said "Wrote same.png" and the later silently replaced the earlier; two queues into one
folder replaced each other's images. A run now claims its outputs when it starts (dm_cli.io.claims) and a second
run stops, exit 2, in one sentence naming the first (its pid and start time).

The first run is a process holding the claim the way a run holds it (the same code, `claim_outputs` /
`claim_folder`): a real `dmap run` takes seconds to start. That a real run takes and releases its claims is
checked in-process."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_dmap

from dm_cli.errors import UsageError
from dm_cli.io.claims import claim_outputs, claim_path

SMALL = ("--steps", 1, "--height", 64, "--width", 64)


class Holder:
    """Another process holding a claim on `path` (a folder's, with folder=True) as `command`."""

    def __init__(self, path: Path, command: str = "dmap run", folder: bool = False):
        take = "claim_folder" if folder else "claim_outputs"
        target = repr(str(path)) if folder else repr([str(path)])
        code = textwrap.dedent(f"""
            import sys, time
            from dm_cli.io.claims import {take}
            claims = {take}({target}, {command!r})
            print("ready", flush=True)
            sys.stdin.read()
            claims.release()
            """)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self) -> None:
        """Ends normally: releases its claim."""
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0

    def terminate(self) -> None:
        """SIGTERM: Python runs no cleanup, so the claim file stays behind; the kernel drops its lock."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == -signal.SIGTERM


@pytest.fixture
def holders():
    made = []
    yield lambda *args, **kwargs: made.append(Holder(*args, **kwargs)) or made[-1]
    for holder in made:
        if holder.proc.poll() is None:
            holder.proc.kill()
            holder.proc.wait()


def _refused_naming(code: int, err: str, holder: Holder, command: str = "dmap run") -> None:
    assert code == 2, err
    assert f"another {command} (pid {holder.pid} on " in err and ", started " in err, err
    assert "wait for it to finish, or choose another --output" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def _must_not_start(monkeypatch):
    import dm_cli.run.sessions.single

    def refuse(*args, **kwargs):
        raise AssertionError("the run started: the second run should have stopped at its claim")

    monkeypatch.setattr(dm_cli.run.sessions.single, "_run", refuse)


def test_a_second_run_of_the_same_output_stops_naming_the_first(tmp_path, holders, monkeypatch):
    out = tmp_path / "same.png"
    first = holders(out)
    _must_not_start(monkeypatch)
    code, _, err = run_dmap("run", "-p", "a fox", *SMALL, "-o", out)
    _refused_naming(code, err, first)
    assert f"The output {out} is being written" in err
    assert not out.exists()
    code, _, err = run_dmap("run", "-p", "a fox", *SMALL, "-o", tmp_path / "other.png", "--save-latents", out)
    _refused_naming(code, err, first)  # --save-latents is claimed too
    first.finish()
    assert not claim_path(out).exists()  # released when the first one ends


def test_a_run_holds_its_claim_while_it_runs_and_gives_it_back_when_it_ends(tmp_path):
    out = tmp_path / "out.png"
    import dm_cli.run.sessions.single as single

    real, seen = single._run, []

    def watched(request, *args):
        seen.append(json.loads(claim_path(out).read_text())["pid"])
        with pytest.raises(UsageError, match=f"pid {os.getpid()} on "):  # a second claim, even in this process
            claim_outputs([out], "dmap run")
        return real(request, *args)

    single._run = watched
    try:
        code, stdout, err = run_dmap("run", "-p", "a fox", *SMALL, "-o", out)
    finally:
        single._run = real
    assert code == 0 and out.is_file(), err
    assert seen == [os.getpid()]
    assert not claim_path(out).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out.png"]


@pytest.mark.parametrize("raised, expected", [(UsageError("bad"), 2), (RuntimeError("bug"), 1),
                                              (KeyboardInterrupt(), 130)])
def test_the_claim_is_given_back_after_an_error_or_ctrl_c(tmp_path, monkeypatch, raised, expected):
    out = tmp_path / "out.png"
    import dm_cli.run.sessions.single

    def fail(*args, **kwargs):
        assert claim_path(out).is_file()
        raise raised

    monkeypatch.setattr(dm_cli.run.sessions.single, "_run", fail)
    code, _, err = run_dmap("run", "-p", "a fox", *SMALL, "-o", out)
    assert code == expected, err
    assert not claim_path(out).exists() and list(tmp_path.iterdir()) == []


def test_a_claim_left_by_a_killed_run_is_taken_over(tmp_path, holders):
    """SIGTERM (or SIGKILL) leaves the claim file, but not its lock: the next run takes it over and writes."""
    out = tmp_path / "out.png"
    gone = holders(out)
    gone.terminate()
    assert json.loads(claim_path(out).read_text())["pid"] == gone.pid  # stale: nobody holds its lock
    code, _, err = run_dmap("run", "-p", "a fox", *SMALL, "-o", out)
    assert code == 0 and out.is_file(), err
    assert not claim_path(out).exists()


def test_a_hand_written_claim_of_a_dead_pid_is_stale(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out = tmp_path / "out.png"
    claim_path(out).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "started": 0,
                                           "command": "dmap run"}))
    with claim_outputs([out], "dmap run") as claims:
        assert claims.paths == [claim_path(out)]
        assert json.loads(claim_path(out).read_text())["pid"] == os.getpid()
    assert not claim_path(out).exists()


def test_a_second_queue_into_the_same_folder_stops_naming_the_first(tmp_path, holders, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\na cat\n")
    first = holders(folder, "dmap run --prompts", folder=True)
    import dm_cli.run.sessions.queue_runner

    monkeypatch.setattr(dm_cli.run.sessions.queue_runner, "_run_share", lambda *a: pytest.fail("the second queue started"))
    code, _, err = run_dmap("run", "--prompts", prompts, *SMALL, "-o", folder)
    _refused_naming(code, err, first, "dmap run --prompts")
    assert f"The output folder {folder} is being written" in err
    assert claim_path(folder).is_file() and list(folder.iterdir()) == []  # the first's claim; nothing of the second's
    first.finish()
    monkeypatch.undo()
    code, _, err = run_dmap("run", "--prompts", prompts, *SMALL, "-o", folder, "-q")
    assert code == 0, err
    assert sorted(p.name for p in folder.iterdir()) == ["00000.png", "00001.png", "manifest.jsonl"]
    assert not claim_path(folder).exists()  # released


@pytest.mark.parametrize("command, args", [
    ("dmap plan", ("plan", "demo", "-o", "{out}")),
    ("dmap shard", ("shard", "{src}", "-o", "{out}")),
    ("dmap demo", ("demo", "tiny-sd15", "-o", "{out}")),
])
def test_plan_shard_and_demo_outputs_are_claimed(tmp_path, holders, command, args):
    out = tmp_path / "result"
    first = holders(out, command)
    code, _, err = run_dmap(*(a.format(out=out, src=tmp_path / "src") for a in args))
    _refused_naming(code, err, first, command)
    assert sorted(p.name for p in tmp_path.iterdir()) == [claim_path(out).name]


def test_under_torchrun_only_rank_0_claims(tmp_path, holders, monkeypatch):
    """The ranks of one run share its outputs (rank 0 writes): they must not refuse each other."""
    from dm_cli.run.sessions.outputs import claim_queue_folder, claim_run_outputs

    out = tmp_path / "out.png"
    holders(out)
    request = SimpleNamespace(output=str(out), save_latents=None)
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    with claim_run_outputs(request) as claims:
        assert claims.paths == []
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="is being written by another dmap run"):
        claim_run_outputs(request)
    assert claim_queue_folder(tmp_path, is_main=False).paths == []


def test_a_claim_file_that_is_a_link_is_refused(tmp_path):
    out = tmp_path / "out.png"
    claim_path(out).symlink_to(tmp_path / "elsewhere")
    code, _, err = run_dmap("run", "-p", "a fox", *SMALL, "-o", out)
    assert code == 2 and "is a symbolic link, not dmap's claim" in err, err
    assert not (tmp_path / "elsewhere").exists()
