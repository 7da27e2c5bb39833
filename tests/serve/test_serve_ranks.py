"""`dmap serve` under torchrun (2 CPU ranks, gloo; rank 0 serves, the ranks share a request's images, as docs/serve.md
says): the two images of one request are `dmap run`'s files byte for byte; rank 0 alone says the server's lines, once;
SIGTERM to the launch (torchrun with `--signals-to-handle` without SIGTERM, as docs/serve.md says) ends torchrun with
143 and no traceback, and every rank with it, exit 0 (a requested stop, as one process's serve)."""

import base64
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_serve import SEED, SERVE_ARGS, SIZE, STEPS, _cache_dir  # noqa: E402 - after the skips

from dm_cli.serve.server import LAUNCH_SIGTERM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_two_ranks_serve_dmap_runs_bytes_and_stop_on_sigterm(tmp_path_factory, tmp_path):
    from conftest import run_dmap

    env = {**os.environ, "DMAP_CACHE_DIR": _cache_dir(tmp_path_factory), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    log, ended = (tmp_path / "err.txt").open("w"), tmp_path / "ended.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT", "-m", "dm_cli", "serve", *SERVE_ARGS]
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(ended), *torchrun], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    ranks: list[int] = []
    served = []
    try:
        line = ""
        deadline = time.time() + 300
        while not line.startswith("http://"):  # rank 0's "Serving demo (...): ...", then its URL alone
            assert reaper.poll() is None and time.time() < deadline, "the launch stopped before serving"
            line = reaper.stdout.readline()
            served.append(line)
        url = urlsplit(line.strip())
        (launcher,) = _children(reaper.pid)
        ranks = _children(launcher)  # torchrun starts each rank in a session of its own
        assert len(ranks) == 2, ranks
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
        connection.request("POST", "/v1/images/generations", body=json.dumps({"prompt": "a red fox", "seed": SEED,
                                                                              "n": 2}).encode(),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        data = json.loads(response.read())
        connection.close()
        assert response.status == 200, data
        for i, item in enumerate(data["data"]):
            code, _, err = run_dmap("run", "-p", "a red fox", "--height", SIZE, "--width", SIZE, "--steps", STEPS,
                                    "--seed", SEED + i, "--mode", "staged", "-o", tmp_path / f"fox{i}.png", "--quiet")
            assert code == 0, err
            assert base64.b64decode(item["b64_json"]) == (tmp_path / f"fox{i}.png").read_bytes(), i
        os.kill(launcher, signal.SIGTERM)  # to torchrun alone (`kill PID`, a container's first process)
        try:
            reaper.wait(120)  # the ranks end with their launcher: rank 0 finishes, then rank 1; the reaper waits for both
        except subprocess.TimeoutExpired:
            pass
    finally:
        if reaper.poll() is None:  # a rank left behind is ended, then reported
            os.killpg(reaper.pid, signal.SIGKILL)
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
            reaper.wait()
        served.append(reaper.stdout.read())
        log.close()
    said = (tmp_path / "err.txt").read_text()
    assert ended.exists(), f"rank process(es) {ranks} still ran 120 s after their launcher stopped: {said}"
    codes = {int(pid): code for pid, code in json.loads(ended.read_text()).items()}
    assert codes[launcher] == -signal.SIGTERM and "Traceback" not in said, said  # a shell says 143
    assert [codes[pid] for pid in ranks] == [0, 0], (codes, said)  # each rank: a requested stop, not a failure
    lines = "".join(served).splitlines() + said.splitlines()
    for start in ("Serving demo (", "Warming up: ", "Stopping (SIGTERM): ", "Stopped after 2 image(s)."):
        assert sum(line.startswith(start) for line in lines) == 1, (start, said)  # rank 0's, unprefixed, once
    assert "[rank " not in said, said  # a rank other than 0 has nothing of its own to say here
    assert LAUNCH_SIGTERM not in said, said  # this torchrun leaves SIGTERM alone: nothing to advise


def test_rank_0_advises_leaving_sigterm_to_torchruns_default_where_torchrun_handles_it():
    """torchrun's own default (SIGTERM handled: its SignalException traceback and exit 1 at any stop) is advised
    against once, on rank 0's start; a launch with SIGTERM left out, or no torchrun, has nothing to advise."""
    from torch.distributed.launcher.api import LaunchConfig

    from dm_cli.serve.server import launch_sigterm_notice

    launch = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_SIGNALS_TO_HANDLE": LaunchConfig.signals_to_handle}
    assert "SIGTERM" in LaunchConfig.signals_to_handle
    assert launch_sigterm_notice(launch) == LAUNCH_SIGTERM
    assert launch_sigterm_notice({**launch, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGINT,SIGHUP,SIGQUIT"}) is None
    assert launch_sigterm_notice({"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM"}) is None  # not under torchrun


# The launch's parent, a Linux subreaper: the ranks that outlive torchrun become its children, so their own exit
# codes are seen (a rank's parent is otherwise torchrun, which dies first). argv: the file for {pid: exit code}, then
# torchrun's command line.
REAPER = """
import ctypes, json, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
launcher = subprocess.Popen(sys.argv[2:])
codes = {launcher.pid: launcher.wait()}
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    codes[pid] = os.waitstatus_to_exitcode(status)
with open(sys.argv[1] + ".part", "w") as out:
    json.dump(codes, out)
os.replace(sys.argv[1] + ".part", sys.argv[1])
"""


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux: /proc/PID/task/TID/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found
