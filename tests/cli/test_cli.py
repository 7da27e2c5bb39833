"""First contact: usage errors, help, Ctrl-C, tables at 80 columns, overwrite policy, small hints.

All in-process (`run_dmap` calls the console entry point with captured output).
"""

import json
import re

import pytest
from conftest import PRESETS, run_dmap

USAGE_ERRORS = {
    "mistyped command": (["inspct", "flux"], "Did you mean 'inspect'?"),
    "mistyped option": (["inspect", "flux", "--jsn"], "Possible options: --json"),
    "missing SOURCE (inspect)": (["inspect"], "Missing argument 'SOURCE'"),
    "missing SOURCE (plan)": (["plan"], "Missing argument 'SOURCE'"),
    "missing SOURCE (shard)": (["shard"], "Missing argument 'SOURCE'"),
    "missing --prompt": (["run"], "Missing option '--prompt'"),
    "steps 0": (["run", "-p", "x", "--steps", "0"], "'--steps'"),
    "depth -1": (["inspect", "flux", "--depth", "-1"], "'--depth'"),
    "height abc": (["plan", "flux", "--height", "abc"], "'--height'"),
    "option without value": (["shard", "x", "--max-shard-size"], "Option '--max-shard-size' requires an argument"),
    "cache option": (["cache", "--nope"], "No such option"),
}


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_errors_exit_2_with_usage_line_and_hint(case):
    args, hint = USAGE_ERRORS[case]
    code, out, err = run_dmap(*args)
    assert code == 2, (out, err)
    assert hint in err
    assert "Usage: dmap" in err or case == "option without value"  # click names no command for this one
    assert "Internal error" not in err and "Traceback" not in err


def test_dmap_alone_prints_the_help():
    code, out, err = run_dmap()
    assert code == 0
    assert "Usage: dmap" in out and all(command in out for command in ("inspect", "shard", "plan", "run", "cache"))


def test_ctrl_c_prints_one_line_and_exits_130(monkeypatch):
    import dm_cli.model.inspection

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dm_cli.model.inspection, "inspect_source", interrupted)
    code, out, err = run_dmap("inspect", "flux")
    assert code == 130
    assert err.strip().startswith("Interrupted") and "nothing was left half-written" in err
    assert len(err.strip().splitlines()) == 1


def test_depth_shows_no_split_markers():
    code, out, err = run_dmap("inspect", "sd15", "-c", "unet", "--depth", "2", env={"COLUMNS": "120"})
    assert code == 0, err
    assert "CrossAttnUpBlock2D [no-split]" in out


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"\d[\d,]*(?:\.\d+)?", text))


def test_inspect_and_plan_flux_at_80_columns_show_every_number_whole():
    from dm_cli.render import num
    from dm_cli.units import format_size

    code, out, err = run_dmap("inspect", "flux", env={"COLUMNS": "80"})
    assert code == 0, err
    code_json, raw, _ = run_dmap("inspect", "flux", "--json")
    report = json.loads(raw)
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    for comp in report["components"]:
        for value in (num(comp["params"]), format_size(comp["bytes"])):
            assert re.search(rf"(?<![\d,.]){re.escape(value)}(?![\d,.])", out), value
    assert num(report["total"]["params"]) in out and format_size(report["total"]["bytes"]) in out

    args = ("plan", "flux", "-m", "0=16GB,1=16GB,cpu=64GB")
    code, out, err = run_dmap(*args, env={"COLUMNS": "80"})
    assert code == 0, err
    plan = json.loads(run_dmap(*args, "--json")[1])
    assert not re.search(r"\S…", out) and max(len(line) for line in out.splitlines()) <= 80
    for stage in plan["stages"]:
        for device, use in stage["breakdown"].items():
            shown = [use["weights"], stage["peak_bytes"][device]] + [use["activations"]] * bool(use["activations"])
            for value in shown:
                assert re.search(rf"(?<![\d,.]){re.escape(format_size(value))}", out), (stage["name"], device, value)
    for comp in plan["components"].values():
        assert format_size(comp["weights_bytes"]) in out
    # what was left out is said, and nothing shown is a fragment of a number
    assert "hidden at 80 columns" in out
    allowed = {n for value in re.findall(r"[\d,.]+ s\b|[\d,.]+ ?[KMGT]?B|[\d,]+", out) for n in _numbers(value)}
    assert _numbers(out) <= allowed  # sizes, counts and (the predicted time) seconds


def test_piped_output_uses_80_columns_and_the_bar_reads_without_colour(monkeypatch):
    import os

    from dm_cli.render import console

    monkeypatch.delenv("COLUMNS", raising=False)

    def no_terminal(*args):
        raise OSError("not a terminal")

    monkeypatch.setattr(os, "get_terminal_size", no_terminal)
    assert console().width == 80
    code, out, err = run_dmap("plan", "flux", "-m", "0=16GB,1=16GB,cpu=64GB", env={"COLUMNS": "160", "NO_COLOR": "1"})
    assert code == 0, err
    assert "bar: █ weights  ▓ offload reserve  ▒ activations  ▪ overhead  · free" in out
    assert re.search(r"│ █+▒*▪+·+ │", out)  # parts drawn with their own glyphs
    assert "\x1b[" not in out


def test_gpus_are_listed_in_index_order():
    code, out, err = run_dmap("plan", "sdxl", "-c", "unet", "--dtype", "fp32", "-m", "0=6GiB,1=10GiB,cpu=30GiB",
                              "--strategy", "balanced_low_0", env={"COLUMNS": "160"})
    assert code == 0, err
    tables, rows = [], []
    for line in out.splitlines():
        device = re.match(r"│(?: [^│]*│)? GPU (\d+) ", line)  # the memory table's device column follows the stage's
        if device:
            rows.append(int(device.group(1)))
        elif rows:
            tables.append(rows)
            rows = []
    assert any(len(t) == 2 for t in tables)
    assert all(t == sorted(t) for t in tables)
    assert "GPU 0, GPU 1, cpu" in out  # GPU 1 runs first in this plan: listed by index all the same


def test_plan_overwrite_policy_and_quiet(tmp_path):
    out_path = tmp_path / "p.json"
    args = ("plan", "tiny-sd15", "-m", "cpu=1GB", "--height", "64", "-o", out_path)
    code, out, err = run_dmap(*args, "-q")
    assert code == 0 and out.strip() == f"Plan written to {out_path}." and err == ""
    before = out_path.read_text()
    code, out, err = run_dmap(*args, "-q")
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert out_path.read_text() == before
    code, out, err = run_dmap(*args, "-q", "--overwrite")
    assert code == 0


def test_cpu_only_plans_offload_nothing_and_use_disk_when_the_cpu_is_small():
    code, out, err = run_dmap("plan", "sd15", "-m", "cpu=10GB", "--height", "512", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["offloaded_bytes"] == 0 and all(c["offloaded_bytes"] == 0 for c in plan["components"].values())
    code, out, err = run_dmap("plan", "sd15", "-m", "cpu=1GB,disk", "--height", "512", "--json")
    assert code == 0, err
    plan = json.loads(out)
    unet = plan["components"]["unet"]
    assert set(unet["device_map"].values()) == {"cpu", "disk"}  # cpu holds what fits, disk the rest
    assert 0 < plan["offloaded_bytes"] == unet["disk_bytes"] < unet["weights_bytes"]
    for stage in plan["stages"]:
        assert stage["peak_bytes"]["cpu"] <= 10**9


SMALL_HINTS = {
    "size without device": (["plan", "flux", "-m", "16GB"], "0=16GB"),
    "plain bytes": (["plan", "flux", "-m", "0=16"], "0=16GB"),
    "missing path": (["inspect", "./nope"], "No such path: ./nope"),
    "mistyped preset": (["inspect", "fluxx"], "did you mean 'flux'?"),
    "unknown cache kind": (["cache", "--kind", "nope"], "Unknown cache kind"),
}


@pytest.mark.parametrize("case", sorted(SMALL_HINTS))
def test_small_hints(case):
    args, hint = SMALL_HINTS[case]
    code, out, err = run_dmap(*args)
    assert code == 2 and hint in err, (out, err)
    assert len(err.strip().splitlines()) == 1


def test_plain_bytes_with_a_unit_are_accepted():
    from dm_cli.units import parse_device_spec

    assert parse_device_spec("0=16B,cpu=2000000")[0].capacity_bytes == 16


def test_cache_lists_and_clears(tmp_path):
    env = {"DMAP_CACHE_DIR": str(tmp_path / "cache")}
    assert run_dmap("inspect", "tiny-flux", env=env)[0] == 0
    code, out, err = run_dmap("cache", "--json", env=env)
    assert code == 0
    usage = json.loads(out)
    assert usage["folder"] == str(tmp_path / "cache") and usage["kinds"]["skeletons"]["files"] >= 4
    code, out, err = run_dmap("cache", "--clear", "--json", env=env)
    cleared = json.loads(out)
    assert cleared["freed_bytes"] > 0 and cleared["kinds"]["skeletons"]["files"] == 0


def test_legacy_bin_weights_are_sized_at_their_stored_dtype(tmp_path):
    import torch
    from diffusers import UNet2DConditionModel

    from dm_cli.model.inspection import inspect_source

    folder = tmp_path / "unet"
    folder.mkdir()
    config = PRESETS / "tiny-sd15" / "unet" / "config.json"
    (folder / "config.json").write_text(config.read_text())
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(config.parent))
    torch.save(unet.state_dict(), folder / "diffusion_pytorch_model.bin")
    report = inspect_source(str(folder))
    comp = report.components[0]
    assert comp.dtype == "float32" and comp.bytes == sum(t.numel() * 4 for t in unet.state_dict().values())
    assert any("read from legacy weights" in note for note in report.notes)
    import datetime

    torch.save({**unet.state_dict(), "saved": datetime.date(2024, 1, 1)}, folder / "diffusion_pytorch_model.bin")
    report = inspect_source(str(folder))
    assert report.components[0].dtype == "bfloat16"
    assert any("were not read" in note and "assume bf16" in note for note in report.notes)


def test_the_contracts_are_in_the_repository_and_cover_the_plan_json():
    from conftest import REPO

    contracts = (REPO / "docs" / "CONTRACTS.md").read_text()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        assert "DESIGN.md" not in doc.read_text(), doc
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 130 |"):
        assert code in contracts
    code, out, err = run_dmap("plan", "tiny-sd15", "-m", "0=1GB,cpu=2GB,disk", "--height", "64", "--json")
    plan = json.loads(out)
    keys = set(plan) | {f"devices.*.{k}" for d in plan["devices"].values() for k in d}
    keys |= {f"components.*.{k}" for c in plan["components"].values() for k in c}
    keys |= {f"stages[*].{k}" for s in plan["stages"] for k in s} | {f"inputs.{k}" for k in plan["inputs"]}
    for key in sorted(keys):
        name = key.rpartition(".")[2]
        assert re.search(rf"[`.\"]{re.escape(name)}[`\"]", contracts), f"{key} is not documented in docs/CONTRACTS.md"


def test_the_process_entry_point_freezes_the_collector_before_teardown_and_main_argv_does_not(monkeypatch):
    """`dmap` (main() without argv) freezes what is alive as the command ends, so the interpreter's teardown does
    not walk torch's objects; a caller of main(argv) (tests, scripts) keeps its collector as it was."""
    import gc
    import sys

    from dm_cli.cli import main

    assert gc.get_freeze_count() == 0
    with pytest.raises(SystemExit):
        main(["--version"])
    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(sys, "argv", ["dmap", "--version"])
    try:
        with pytest.raises(SystemExit) as done:
            main()
        assert done.value.code == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
