"""Issue 41 item 15: under torchrun every rank checks the same command, and each printed the same error (twice
above torchrun's own summary). Rank 0 says a usage error as one process does; another rank keeps it to itself for
RANK_0_FIRST_S (torchrun stops it once rank 0 has exited 2), then says it once, prefixed with its rank (an error of
its own). tests/hostile/test_pipeline_signals.py checks a real 3-rank launch."""

from __future__ import annotations

import time

import pytest
from conftest import run_dmap

import dm_cli.cli._errors as errors

TORCHRUN = {"TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}
WAIT_S = 0.5


@pytest.fixture
def short_wait(monkeypatch):
    monkeypatch.setattr(errors, "RANK_0_FIRST_S", WAIT_S)


@pytest.mark.parametrize("args, words", [
    (("run", "--prompt", "x", "--steps", "0"), "Error: Invalid value for '--steps'"),  # click's usage errors
    (("run", "--prompt", "x", "--guidance-scale", "1e308", "-o", "x.png"), "Error: --guidance-scale must be"),  # dmap's
], ids=["option", "value"])
def test_rank_1_keeps_a_usage_error_for_rank_0_then_says_it_once_prefixed(short_wait, tmp_path, args, words):
    started = time.monotonic()
    code, out, err = run_dmap(*args, env={**TORCHRUN, "RANK": "1", "LOCAL_RANK": "1"}, cwd=tmp_path)
    assert code == 2 and time.monotonic() - started >= WAIT_S
    assert err.strip().startswith(f"[rank 1/2] {words}") and err.strip().count("\n") == 0, err
    assert "Usage:" not in err and not out


def test_rank_0_says_a_usage_error_at_once_as_one_process_does(short_wait, tmp_path):
    started = time.monotonic()
    code, _, err = run_dmap("run", "--prompt", "x", "--steps", "0", env={**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"},
                            cwd=tmp_path)
    assert code == 2 and time.monotonic() - started < WAIT_S
    assert err.startswith("Usage: dmap run") and "Error: Invalid value for '--steps'" in err and "[rank" not in err
