"""Hostile input, round 2 (issue 18): each test is the attack, and expects one sentence with exit 2 or 3.

Numbers that overflow or that no real run could use, plan files that only had the right types, an
activation estimate lost to an overflowing trace, an empty --dtype. All are caught before any weights
load (most before anything is traced).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_hostile import _plan_document, _runner_must_not_start, _set, cli

NINES = "9" * 400  # float() of this is inf: int(round(inf)) was an OverflowError (exit 1)


# --- 4. sizes are finite and bounded ---------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--max-memory", f"0={NINES}GB"], "more than 1 EiB"),
    (["--max-memory", f"0={NINES}"], "more than 1 EiB"),
    (["--max-memory", f"0=16GB,cpu={NINES}.5GiB"], "more than 1 EiB"),
    (["--max-memory", "0=10000000TB"], "more than 1 EiB"),
    (["--max-memory", "0=16GB,disk=" + NINES + "TB"], "more than 1 EiB"),
    (["--max-memory", "0=16GB", "--overhead", f"0={NINES}MB"], "more than 1 EiB"),
])
def test_4_sizes_that_overflow_are_exit_2(capsys, args, words):
    code, out, err = cli(capsys, "plan", "tiny-flux", "-q", *args)
    assert code == 2 and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("text", [NINES, f"{NINES}GB", "1e400GB", f"{NINES}.5", 2**61, "1200PB", "2000000TB"])
def test_4_parse_size_refuses_what_overflows_or_no_device_has(text):
    from dm_cli.errors import UsageError
    from dm_cli.units import parse_size

    with pytest.raises(UsageError):
        parse_size(text)


def test_4_parse_size_is_exact_up_to_the_bound():
    from dm_cli.errors import UsageError
    from dm_cli.units import MAX_SIZE_BYTES, parse_size

    assert parse_size("1048576TiB") == parse_size(2**60) == MAX_SIZE_BYTES == 2**60
    with pytest.raises(UsageError, match="more than 1 EiB"):
        parse_size("1048576.001TiB")
    assert parse_size("0.000000001GB") == 1 and parse_size("1.5GB") == 1_500_000_000


@pytest.mark.parametrize("total", ["1e400", "-1", "1.5", '"12"', "true", str(10**30)])
def test_4_index_total_size_that_is_not_a_byte_count_is_exit_2(tmp_path, capsys, total):
    """`"total_size": 1e400` is inf once parsed: int(inf) was an OverflowError (exit 1)."""
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"metadata": {"total_size": %s}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}'
                     % total)
    code, out, err = cli(capsys, "inspect", index)
    assert code == 2 and "model.safetensors.index.json" in err and "total_size" in err, err


# --- 5. counts a real run could use, checked before anything loads ---------------------------------


RUN_COUNTS = {
    "steps": (["--steps", "100000000000000000000"], "--steps must be a whole number >= 1 (at most 10000)"),
    "num-images": (["--num-images", "1000000000"], "--num-images must be a whole number >= 1 (at most 10000)"),
    "height": (["--height", "1000000"], "--height must be a whole number >= 0 (at most 16384)"),
    "width": (["--width", "1000000"], "--width must be a whole number >= 0 (at most 16384)"),
    "frames": (["--frames", "4000001"], "--frames must be a whole number >= 1 (at most 4097)"),
    "fps": (["--fps", "1000000000"], "--fps must be a whole number >= 1 (at most 1000)"),
    "max-sequence-length": (["--max-sequence-length", "1000000000"],
                            "--max-sequence-length must be a whole number >= 1 (at most 4096)"),
    "dtype empty": (["--dtype", ""], "Unknown dtype ''"),
}


@pytest.mark.parametrize("case", sorted(RUN_COUNTS))
def test_5_absurd_run_counts_are_exit_2_before_anything_loads(tmp_path, monkeypatch, capsys, case):
    """`--num-images 1000000000` hung building output names; `--steps 1e20` failed after loading (exit 1)."""
    args, words = RUN_COUNTS[case]
    _runner_must_not_start(monkeypatch)
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "run", "-p", "x", *args)
    assert code == 2 and words in err and err.count("\n") == 1, err
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("args", [["--steps", "100000"], ["--max-sequence-length", "100000"]])
def test_5_absurd_counts_for_a_queue_are_exit_2_before_anything_loads(tmp_path, monkeypatch, capsys, args):
    import dm_cli.run.sessions.session
    import dm_cli.run.settle.settle

    def refuse(*a, **k):
        raise AssertionError("the pipeline was made: the bad input should have been caught before")

    monkeypatch.setattr(dm_cli.run.settle.settle, "settle", refuse)  # where SOURCE is resolved and the plan made
    monkeypatch.setattr(dm_cli.run.sessions.session.Session, "__init__", refuse)
    (tmp_path / "p.txt").write_text("a fox\n")
    code, out, err = cli(capsys, "run", "--prompts", tmp_path / "p.txt", "-o", tmp_path / "out", *args)
    assert code == 2 and "at most" in err, err


PLAN_COUNTS = {
    "batch-size": (["--batch-size", "1000000000000000000"], "--batch-size must be a whole number >= 1 (at most 1024)"),
    "num-images": (["--num-images", "1000000000"], "--num-images must be a whole number >= 1 (at most 10000)"),
    "height": (["--height", "1000000"], "--height must be a whole number >= 0 (at most 16384)"),
    "max-sequence-length": (["--max-sequence-length", "1000000000"], "(at most 4096)"),
}


@pytest.mark.parametrize("case", sorted(PLAN_COUNTS))
def test_5_absurd_plan_counts_are_exit_2(capsys, case):
    """Item 7's attack too: `--batch-size 1e18` said it fits (exit 0), its activation estimate lost."""
    args, words = PLAN_COUNTS[case]
    code, out, err = cli(capsys, "plan", "tiny-flux", "-q", "--max-memory", "0=80GB", *args)
    assert code == 2 and words in err and err.count("\n") == 1, err


def test_5_absurd_frames_for_a_video_plan_are_exit_2(capsys):
    code, out, err = cli(capsys, "plan", "tiny-wan", "-q", "--max-memory", "0=80GB", "--frames", "4000001")
    assert code == 2 and "--frames must be a whole number >= 1 (at most 4097)" in err, err


def test_5_the_python_api_has_the_same_bounds():
    import dm_cli
    from dm_cli.errors import UsageError
    from dm_cli.run.sessions.session import _items

    with pytest.raises(UsageError, match="at most 1024"):
        dm_cli.plan("tiny-flux", max_memory="0=80GB", batch_size=10**18)
    with pytest.raises(UsageError, match="steps must be a whole number >= 1 \\(at most 10000\\)"):
        _items(["a fox"], 0, None, 10**20, None)  # what Session.generate(prompts, steps=...) checks first
    with pytest.raises(UsageError, match="at most 4096"):
        dm_cli.load(None, max_sequence_length=10**9)


def test_5_a_queue_item_gets_the_same_steps_bound():
    """A line's steps get --steps' bound where the line is read, the line named; an item built in Python cannot hold
    them either (its settings are a Generation)."""
    from dm_cli.errors import UsageError
    from dm_cli.inputs import Generation
    from dm_cli.run.sessions.queue import queue_item

    with pytest.raises(UsageError, match="Item 3: 'steps' must be a whole number >= 1 \\(at most 10000\\)"):
        queue_item({"prompt": "a fox", "steps": 10**20}, 3, 0, "Item 3")
    with pytest.raises(UsageError, match="steps must be a whole number >= 1 \\(at most 10000\\)"):
        Generation(steps=10**20)


# --- 6. a plan file passes the checks of the command line that could have written it -----------------


PLAN_FIELDS = {
    "dtype nonexistent": (("dtype",), "nonexistent", "Unknown dtype 'nonexistent'"),
    "dtype empty": (("dtype",), "", "Unknown dtype ''"),
    "height huge": (("inputs", "height"), 10**9, "--height must be a whole number >= 0 (at most 16384)"),
    "width huge": (("inputs", "width"), 10**9, "--width must be a whole number >= 0 (at most 16384)"),
    "batch huge": (("inputs", "batch_size"), 10**18, "--batch-size must be a whole number >= 1 (at most 1024)"),
    "images huge": (("inputs", "num_images"), 10**9, "--num-images must be a whole number >= 1 (at most 10000)"),
    "sequence huge": (("inputs", "max_sequence_length"), 10**9, "(at most 4096)"),
    "frames huge": (("inputs", "num_frames"), 10**9, "--frames must be a whole number >= 1 (at most 4097)"),
    "frames a string": (("inputs", "num_frames"), "81", "--frames must be a whole number"),
    "fps zero": (("inputs", "fps"), 0, "--fps must be a whole number >= 1"),
    "fps huge": (("inputs", "fps"), 10**9, "--fps must be a whole number >= 1 (at most 1000)"),
    "fps a float": (("inputs", "fps"), 1.5, "--fps must be a whole number"),
    "mode bogus": (("mode",), "bogus", "'mode' must be auto, resident or staged"),
    "strategy bogus": (("strategy",), "bogus", "'strategy' must be auto, sequential, balanced or balanced_low_0"),
    "storage dtype bogus": (("components", "vae", "storage_dtype"), "bogus", "storage_dtype must be"),
    "gpu not in devices": (("components", "vae", "device_map", ""), 7, "GPU 7, which its 'devices' do not list"),
    "gpu index huge": (("devices", str(10**20)), {"capacity_bytes": 1}, "GPU index"),
    "execution device not in devices": (("components", "vae", "execution_device"), 5, "GPU 5"),
    "stage device not in devices": (("stages", 0, "peak_bytes", "3"), 1, "GPU 3"),
    "device_map key a path": (("components", "vae", "device_map", "../../etc"), 0, "device_map key '../../etc'"),
    "device_map key spaces": (("components", "vae", "device_map", " "), 0, "device_map key ' '"),
    "capacity beyond 1 EiB": (("devices", "0", "capacity_bytes"), 10**30, "at most 1 EiB"),
}


@pytest.mark.parametrize("case", sorted(PLAN_FIELDS))
def test_6_plan_file_fields_get_the_command_lines_checks(tmp_path, monkeypatch, capsys, case):
    """`"dtype": "nonexistent"` reached getattr(torch, ...) (exit 1); a huge height blew memory; a bogus mode,
    fps, storage dtype or GPU was accepted. Each is exit 2 naming the field, before anything loads."""
    path, value, words = PLAN_FIELDS[case]
    (tmp_path / "plan.json").write_text(json.dumps(_set(_plan_document(), path, value)))
    _runner_must_not_start(monkeypatch)
    code, out, err = cli(capsys, "run", "-p", "x", "-d", tmp_path / "plan.json", "-o", tmp_path / "x.png")
    assert code == 2 and words in err and err.count("\n") == 1, err


def test_6_a_plan_dmap_wrote_still_loads(tmp_path, capsys):
    from dm_cli.planning.plan_file import load_plan

    out = tmp_path / "p.json"
    code, _, err = cli(capsys, "plan", "tiny-flux", "-q", "--max-memory", "0=1MB,1=1MB,cpu=1GB,disk", "-o", out)
    assert code == 0, err
    plan = load_plan(out)
    assert plan.dtype == "bfloat16" and plan.mode in ("resident", "staged")


# --- 7. an activation estimate that overflows is never dropped -------------------------------------


def test_7_an_overflowing_trace_does_not_fit(capsys, monkeypatch):
    """The meta trace of a huge call fails with "Storage size calculation overflowed": the plan used to go on
    without an activation estimate and say it fits (exit 0). Too big to count is too big to fit: exit 3."""
    import dm_cli.planning.trace.trace

    def overflow(*args, **kwargs):
        raise RuntimeError("Storage size calculation overflowed with sizes=[1000000000000000000, 4096, 4]")

    monkeypatch.setattr(dm_cli.planning.trace.trace, "_run", overflow)
    code, out, err = cli(capsys, "plan", "tiny-flux", "-q", "--max-memory", "0=80GB", "--no-cache")
    assert code == 3 and "too large to count" in err and err.count("\n") == 1, err


# --- 12. an empty --dtype is an unknown dtype ------------------------------------------------------


@pytest.mark.parametrize("command", [["plan", "tiny-flux", "-q", "--max-memory", "0=80GB"], ["inspect", "tiny-flux"]])
def test_12_empty_dtype_is_exit_2(capsys, command):
    code, out, err = cli(capsys, *command, "--dtype", "")
    assert code == 2 and "Unknown dtype ''" in err and err.count("\n") == 1, err


def test_12_empty_dtype_for_shard_is_exit_2(tmp_path, capsys):
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    code, out, err = cli(capsys, "shard", tmp_path / "m.safetensors", "--dtype", "", "-o", tmp_path / "out")
    assert code == 2 and "Unknown dtype ''" in err, err
    assert not (tmp_path / "out").exists()


def test_12_empty_dtype_for_the_api_is_refused():
    import dm_cli
    from dm_cli.errors import UsageError

    with pytest.raises(UsageError, match="Unknown dtype ''"):
        dm_cli.plan("tiny-flux", max_memory="0=80GB", dtype="")
    with pytest.raises(UsageError, match="Unknown dtype ''"):
        dm_cli.load(None, dtype="")
