"""`dmap serve` under torchrun (2 CPU ranks, gloo; rank 0 serves, the ranks share a request's images, as docs/serve.md
says): the two images of one request are `dmap run`'s files byte for byte; each rank's lines say its rank; SIGTERM to
the launch (torchrun with `--signals-to-handle` without SIGTERM, as docs/serve.md says) ends it with 143, no traceback,
and every rank with it."""

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

REPO = Path(__file__).resolve().parents[2]


def test_two_ranks_serve_dmap_runs_bytes_and_stop_on_sigterm(tmp_path_factory, tmp_path):
    from conftest import run_dmap

    env = {**os.environ, "DMAP_CACHE_DIR": _cache_dir(tmp_path_factory), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    log = (tmp_path / "err.txt").open("w")
    launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT", "-m", "dm_cli", "serve", *SERVE_ARGS],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    ranks: list[int] = []
    try:
        line = ""
        deadline = time.time() + 300
        while "http://" not in line:  # rank 0's "Serving demo (...) on http://127.0.0.1:PORT; ..."
            assert launch.poll() is None and time.time() < deadline, "the launch stopped before serving"
            line = launch.stdout.readline()
        url = urlsplit(line.split(" on ", 1)[1].split(";", 1)[0])
        ranks = _children(launch.pid)  # torchrun starts each rank in a session of its own
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
        launch.send_signal(signal.SIGTERM)  # to torchrun alone (`kill PID`, a container's first process)
        code = launch.wait(60)
        end = time.time() + 120
        while ranks and time.time() < end:  # the ranks end with their launcher: rank 0 finishes, then rank 1
            ranks = [pid for pid in ranks if _alive(pid)]
            time.sleep(0.2)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
        log.close()
        for pid in ranks:  # a rank left behind is ended, then reported
            os.kill(pid, signal.SIGKILL)
    said = (tmp_path / "err.txt").read_text()
    assert not ranks, f"rank process(es) {ranks} still ran after their launcher stopped"
    assert code == -signal.SIGTERM and "Traceback" not in said, said  # a shell says 143
    assert "[rank 1/2] " in said and "[rank 0/2] Stopping (SIGTERM)" in said, said


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux: /proc/PID/task/TID/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
