"""`dmap calibrate` like the other commands (issue 57, item 3): its device and output checked before anything is
measured (`--device cuda:0` without CUDA and `cuda:٣` were internal errors, `-o missing/x.json` and `-o FOLDER
--overwrite` failed after the whole measurement), progress while it measures, a busy machine warned of and its
figures not saved as the default profile without --force, its own --overwrite help, figures in at most 4
significant digits. The checks are tested with the measurement replaced (`measure_device`); one quick real run
shows the progress."""

import json
import os
import shlex

import pytest
from conftest import run_dmap

from dm_cli.planning.time.calibrate import Calibration
from dm_cli.planning.time.profiles import DeviceProfile, default_profile_path, table_profile

WIDE = {"COLUMNS": "1000"}


def _profile(**changes) -> DeviceProfile:
    data = {**table_profile("l40s").to_json(), "name": "test device", "measured": True, **changes}
    return DeviceProfile.from_json(data)


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The measurement replaced by one that says two steps and returns a fixed profile (its spread settable); the
    machine quiet (load 0 on 4 cores) unless a test says otherwise; dmap's cache a folder of the test's own."""
    monkeypatch.setenv("DMAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    calls = {"count": 0, "spread": 1.0, "profile": _profile()}

    def fake(sizes, device, on_progress=None):
        calls["count"] += 1
        on_progress("Measuring matmuls (step 1 of 2)")
        on_progress("Measuring memory (step 2 of 2)")
        return Calibration(calls["profile"], calls["spread"])

    monkeypatch.setattr("dm_cli.cli.calibrate.measure_device", fake)
    return calls


def _refused(*args) -> str:
    code, out, err = run_dmap(*args, env=WIDE)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_gpu_this_machine_lacks_is_refused_before_measuring(measured):
    torch = pytest.importorskip("torch")
    absent = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    err = _refused("calibrate", "--device", absent)
    assert absent in err and "--device cpu" in err, err
    _refused("calibrate", "--device", "cuda:9999")
    assert measured["count"] == 0


@pytest.mark.parametrize("device", ["cuda:٣", "cuda:", "cuda:-1", "gpu", "cuda:0x1", "cpu:0", "cuda:1 "])
def test_a_device_that_is_not_cpu_or_cuda_n_in_ascii_digits_is_refused(measured, device):
    err = _refused("calibrate", "--device", device)
    assert "--device must be cpu or cuda:N" in err, err
    assert measured["count"] == 0


def test_an_output_in_a_missing_folder_is_refused_before_measuring(measured, tmp_path):
    err = _refused("calibrate", "-o", tmp_path / "missing" / "x.json")
    assert "does not exist" in err, err
    assert measured["count"] == 0


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_an_output_that_is_a_folder_is_refused_before_measuring(measured, tmp_path, overwrite):
    err = _refused("calibrate", "-o", tmp_path, *overwrite)
    assert "is a folder" in err, err
    assert measured["count"] == 0


def test_an_existing_output_needs_overwrite_as_everywhere(measured, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("old")
    err = _refused("calibrate", "-o", path)
    assert "--overwrite" in err and measured["count"] == 0, err
    code, out, err = run_dmap("calibrate", "-o", path, "--overwrite", env=WIDE)
    assert code == 0, err
    assert DeviceProfile.from_json(json.loads(path.read_text())) == measured["profile"]


def test_progress_says_what_is_measured_and_how_far_on_stderr(measured):
    code, out, err = run_dmap("calibrate", env=WIDE)
    assert code == 0, err
    assert "Measuring matmuls (step 1 of 2)" in err and "(step 2 of 2)" in err, err
    assert "step" not in out, out
    code, out, err = run_dmap("calibrate", "--quiet", env=WIDE)
    assert code == 0 and "step" not in err, err


def test_a_real_quick_calibration_counts_its_steps(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    path = tmp_path / "cpu.json"
    code, out, err = run_dmap("calibrate", "--quick", "--device", "cpu", "-o", path, env=WIDE)
    assert code == 0, err
    steps = [line for line in err.splitlines() if line.startswith("Measuring")]
    total = len(steps)
    assert total >= 8 and steps[0].endswith(f"(step 1 of {total})") and steps[-1].endswith(f"({total} of {total})"
                                                                                            .replace("(", "(step ")), steps


def test_a_busy_machine_is_warned_of_and_not_saved_as_the_default(measured, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 8.0, 8.0))  # a busy loop on every core, and more
    code, out, err = run_dmap("calibrate", "--device", "cpu", env=WIDE)
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("warning: the machine is busy (load average 8 on 4 core(s))"), err
    err = lines[-1]  # warned before measuring, refused after
    assert err.startswith("Error: The machine was busy") and "--force" in err, err
    assert not default_profile_path().exists()
    hint = err.split("or ", 1)[1].split(" to save", 1)[0]  # the command it prints, run as printed
    assert hint == "dmap calibrate --device cpu --force", err
    code, out, err = run_dmap(*shlex.split(hint)[1:], env=WIDE)
    assert code == 0, err
    assert "warning:" in err and "busy" in err, err
    assert DeviceProfile.from_json(json.loads(default_profile_path().read_text())) == measured["profile"]


def test_a_steady_load_but_scattered_repeats_count_as_busy(measured):
    measured["spread"] = 3.0
    code, out, err = run_dmap("calibrate", env=WIDE)
    assert code == 2 and err.strip().splitlines()[-1].startswith("Error: The machine was busy"), err
    assert "3x apart" in err and not default_profile_path().exists(), err


def test_busy_figures_written_to_a_named_file_are_kept_with_a_warning(measured, monkeypatch, tmp_path):
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 8.0, 8.0))
    path = tmp_path / "busy.json"
    code, out, err = run_dmap("calibrate", "-o", path, env=WIDE)
    assert code == 0 and path.is_file(), err
    assert "warning:" in err and "busy" in err and not default_profile_path().exists(), err
    code, out, err = run_dmap("calibrate", "-o", path, "--overwrite", "--json", env=WIDE)
    assert code == 0, err
    assert json.loads(out)["load"] == {"load_average": 8.0, "cores": 4, "spread": 1.0, "busy": True}


def test_a_quiet_machine_saves_the_default_without_force(measured):
    code, out, err = run_dmap("calibrate", env=WIDE)
    assert code == 0, err
    assert "warning" not in err and default_profile_path().is_file()
    assert f"Profile written to {default_profile_path()}" in out, out


def test_its_overwrite_help_is_its_own(measured):
    code, out, err = run_dmap("calibrate", "--help", env=WIDE)
    assert code == 0, err
    text = " ".join(out.split())
    assert "--save-latents" not in text and "--no-resume" not in text, text
    assert "Replace the -o file if it exists" in text and "--force" in text, text


def test_figures_are_printed_in_at_most_4_significant_digits(measured):
    measured["profile"] = _profile(op_seconds=2.0004e-3, link_latency_s=2.0004e-3, memory_gbps=12345.6,
                                   collective_latency_s=1.23456e-4, collective_gbps=0.0123456)
    code, out, err = run_dmap("calibrate", env=WIDE)
    assert code == 0, err
    assert "2,000 us per op" in out and "2,000 us per message on the link" in out, out
    assert "memory 12,350 GB/s" in out and "an all-to-all 123.5 us and 0.01235 GB/s" in out, out
    assert "e+" not in out, out
