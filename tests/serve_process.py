"""A real `dmap serve` child process for the tests that are about the process (its sockets, signals, memory):
started until it prints its "Serving ..." line and the URL on the next, stopped as a user stops it."""

import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit


def start_serve(args: list, *, cwd, env: dict, stderr, preexec_fn=None) -> tuple[subprocess.Popen, str]:
    """`python -m dm_cli serve ARGS`: the process and its URL, once it serves. stderr: a file (a pipe nobody reads
    would stop a server that logs without end) or subprocess.PIPE."""
    proc = subprocess.Popen([sys.executable, "-m", "dm_cli", "serve", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=preexec_fn)
    line = proc.stdout.readline()  # "Serving demo (...): ...; Listening on:", then "http://127.0.0.1:PORT" alone
    line += proc.stdout.readline() if line.startswith("Serving") else ""
    if "http://" not in line:
        proc.kill()
        proc.wait()
        errors = proc.stderr.read() if stderr == subprocess.PIPE else Path(stderr.name).read_text(errors="replace")
        raise AssertionError(f"no server: {line}{errors}")
    return proc, line[line.index("http://"):].split()[0]


def port_of(url: str) -> int:
    return urlsplit(url).port


def stop_serve(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM (what a service manager sends), SIGKILL past `timeout`: the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
