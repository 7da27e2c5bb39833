"""Device profiles as untrusted input (issue 57, item 1): `--profile` and the calibrated profile in dmap's cache are
files a user or another program may have damaged. A FIFO, a device or a folder is refused before it is opened (a
FIFO used to hang, /dev/zero to grow without bound), a deeply nested file is one sentence (it was an internal
RecursionError), every rate is within what a device can be (5e-324 TFLOP/s made the plan's seconds infinite, and
its JSON not JSON), and a damaged calibrated profile is ignored with one line, never stopping a plan or a run."""

import json
import math
import os
import time
from pathlib import Path

import pytest
from conftest import run_dmap
from test_hostile_env import within

from dm_cli.errors import UsageError
from dm_cli.planning.time.profiles import (
    DeviceProfile,
    cached_profile,
    cached_profile_problem,
    default_profile_path,
    read_profile,
    table_profile,
)

TINY = "tiny-flux"  # a preset: plans without weights
WIDE = {"COLUMNS": "1000"}  # a warning naming a long temporary path on one line
DEEP = "[" * 200_000  # 200 KB: within the size cap, far past json's recursion


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every JSON parser but Python's does."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def _refused(*args) -> str:
    code, out, err = run_dmap(*args)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_deeply_nested_profile_is_one_sentence(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text(DEEP)
    err = _refused("plan", TINY, "--profile", path)
    assert "nested too deeply" in err and str(path) in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file"):
        within(lambda: read_profile(fifo), tmp_path, 10)
    code, _, err = within(lambda: run_dmap("plan", TINY, "--profile", fifo), tmp_path, 60)
    assert code == 2 and "not a regular file" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_dev_zero_is_refused_without_reading_it():
    started = time.monotonic()
    with pytest.raises(UsageError, match="not a regular file"):
        within(lambda: read_profile("/dev/zero"), Path("/nonexistent"), 10)
    assert time.monotonic() - started < 5


def test_a_folder_is_refused(tmp_path):
    err = _refused("plan", TINY, "--profile", tmp_path)
    assert "not a regular file" in err, err


def test_a_large_file_is_refused_by_what_is_read(tmp_path):
    path = tmp_path / "large.json"
    path.write_text(" " * 1_000_001)
    with pytest.raises(UsageError, match="larger than 1,000,000 bytes"):
        read_profile(path)


def _with(**changes) -> str:
    return json.dumps({**table_profile("l40s").to_json(), **changes})


@pytest.mark.parametrize("document", [
    _with(matmul_tflops={"bfloat16": 5e-324}), _with(attention_tflops={"bfloat16": 1e-300}),
    _with(matmul_tflops={"bfloat16": 2e4}), _with(memory_gbps=5e-324), _with(host_gbps=1e-300),
    _with(link_gbps=1e9), _with(elementwise_gbps=1e-12), _with(collective_gbps=5e-324),
    _with(matmul_curve={"bfloat16": [[1e6, 5e-324], [1e8, 1.0]]}),
    _with(matmul_curve={"bfloat16": [[5e-324, 1.0], [1e-323, 1.0]]}),
    _with(hook_seconds=2.0), _with(link_latency_s=1e300),
])
def test_a_rate_outside_what_a_device_can_be_is_refused(tmp_path, document):
    path = tmp_path / "tiny.json"
    path.write_text(document)
    err = _refused("plan", TINY, "--profile", path)
    assert "not a device's" in err, err


def test_a_profile_at_the_bounds_plans_finite_seconds_in_strict_json(tmp_path):
    slowest = {"bfloat16": 1e-6, "float32": 1e-6}
    path = tmp_path / "slow.json"
    path.write_text(_with(matmul_tflops=slowest, attention_tflops=slowest, memory_gbps=1e-3, host_gbps=1e-3,
                          link_gbps=1e-3, op_seconds=1.0))
    code, out, err = run_dmap("plan", TINY, "-m", "0=80GB", "--profile", path, "--queue", "1000000", "--json")
    assert code == 0, err
    predicted = strict_json(out)["predicted_time"]
    assert predicted["profile_origin"] == "file"
    assert all(math.isfinite(v) for v in predicted.values() if isinstance(v, float)), predicted


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """Where this machine's calibrated profile is read from, in a cache of the test's own."""
    monkeypatch.setenv("DMAP_CACHE_DIR", str(tmp_path / "cache"))
    path = default_profile_path()
    path.parent.mkdir(parents=True)
    return path


@pytest.mark.parametrize("document", [DEEP, "not json", "\xff\xfe", _with(matmul_tflops={"bfloat16": 5e-324})])
def test_a_damaged_calibrated_profile_is_ignored_with_one_line(cached, document):
    cached.write_text(document, encoding="latin-1")
    assert cached_profile() is None
    problem = cached_profile_problem()
    assert problem and str(cached) in problem and "dmap calibrate" in problem, problem
    code, out, err = run_dmap("plan", TINY, "-m", "cpu=8GB", env=WIDE)
    assert code == 0, err
    assert out.count(str(cached)) == 1 and "dmap calibrate" in out, out
    code, out, err = run_dmap("plan", TINY, "-m", "cpu=8GB", "--json")
    assert code == 0, err
    plan = strict_json(out)
    assert plan.get("predicted_time", {}).get("profile_origin") != "cached"
    assert [w for w in plan["warnings"] if str(cached) in w] == [problem]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_as_the_calibrated_profile_does_not_hang_a_plan(cached):
    os.mkfifo(cached)
    code, out, err = within(lambda: run_dmap("plan", TINY, "-m", "cpu=8GB", env=WIDE), cached.parent, 60)
    assert code == 0 and "not a regular file" in out, (out, err)


def test_a_damaged_calibrated_profile_does_not_stop_a_run(cached, tmp_path):
    pytest.importorskip("torch")
    cached.write_text(DEEP)
    image = tmp_path / "out.png"
    code, out, err = run_dmap("run", "demo", "--prompt", "a fox", "--steps", "1", "--height", "64", "--width", "64",
                              "-o", image, env=WIDE)
    assert code == 0, err
    assert image.is_file() and str(cached) in out + err and "dmap calibrate" in out + err, (out, err)


def test_a_good_calibrated_profile_still_reads(cached):
    profile = DeviceProfile.from_json(table_profile("l40s").to_json())
    cached.write_text(json.dumps(profile.to_json()))
    assert cached_profile() == profile and cached_profile_problem() is None
