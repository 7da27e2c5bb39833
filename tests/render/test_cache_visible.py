"""The step cache is visible (issue 41, items 8 and 9): `dmap plan`'s tables name the cache and the bytes it holds
per device, `dmap run` and a queue say how many denoiser calls ran in full and how many the cache skipped, and
`dmap run -d PLAN --cache none` runs a cached plan without its cache: the bytes of the same plan made without one."""

from __future__ import annotations

import json

import pytest
from conftest import PRESETS, run_dmap

PLACE = ["--max-memory", "cpu=10GB", "--height", "64", "--width", "64"]
STEPS = ["--steps", "6", "--seed", "3"]


def flat(text: str) -> str:
    """Printed text with the terminal's wrapping undone."""
    return " ".join(text.split())


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A tiny FLUX with random weights, planned with taylorseer and without a cache: (folder, cached, bare, outputs
    of the two plan commands)."""
    from dm_cli.model.demo import write_random_pipeline

    folder = tmp_path_factory.mktemp("visible")
    model = write_random_pipeline(PRESETS / "tiny-flux", folder / "tiny-flux", seed=0)
    code, cached_out, err = run_dmap("plan", model, *PLACE, "--cache", "taylorseer", "-o", folder / "cached.json",
                                     env={"COLUMNS": "160"})
    assert code == 0, err
    code, bare_out, err = run_dmap("plan", model, *PLACE, "-o", folder / "bare.json", env={"COLUMNS": "160"})
    assert code == 0, err
    return folder, folder / "cached.json", folder / "bare.json", cached_out, bare_out


def test_plan_tables_name_the_cache_and_its_bytes(plans):
    from dm_cli.units import format_size

    _, cached, _, cached_out, bare_out = plans
    held = json.loads(cached.read_text())["step_cache"]["components"]["transformer"]
    assert held["total_bytes"] > 0 and list(held["bytes"]) == ["cpu"]
    text = flat(cached_out)
    assert ("Step cache: taylorseer (cache_interval=5, disable_cache_before_step=3, lite=auto, max_order=1): "
            f"transformer holds {format_size(held['total_bytes'])} between steps on cpu, counted in the peaks.") in text
    header = next(line for line in cached_out.splitlines() if "weights" in line and "peak" in line)
    assert "step cache" in header and "░ cache" in cached_out  # the memory table's column and the bar's legend
    assert "Step cache" not in bare_out and "step cache" not in bare_out and "░" not in bare_out


@pytest.fixture(scope="module")
def cached_run(plans):
    """`dmap run -d` the taylorseer plan: (its printed summary, the image)."""
    folder, cached, _, _, _ = plans
    code, out, err = run_dmap("run", "-d", cached, "-p", "a fox", *STEPS, "-o", folder / "cached.png")
    assert code == 0, err
    return out, folder / "cached.png"


def test_run_and_queue_say_the_calls_the_cache_skipped(plans, cached_run, tmp_path):
    import re

    _, cached, _, _, _ = plans
    said = re.search(r"Step cache taylorseer: transformer computed (\d+) of (\d+) calls in full, skipped (\d+)\.",
                     flat(cached_run[0]))
    assert said, cached_run[0]
    computed, calls, skipped = map(int, said.groups())
    assert calls == 6 and computed + skipped == calls and skipped > 0  # FLUX: one call a step; taylorseer skips some
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\na lighthouse\n")
    code, out, err = run_dmap("run", "-d", cached, "--prompts", prompts, *STEPS, "-o", tmp_path / "queue")
    assert code == 0, err
    assert (f"Step cache taylorseer: transformer computed {2 * computed} of 12 calls in full, skipped "
            f"{2 * skipped}.") in flat(out)


def test_cache_none_runs_the_plan_without_its_cache(plans, cached_run, tmp_path):
    from dm_cli.io.outputs import read_metadata

    _, cached, bare, _, _ = plans
    for name, args in {"none": [cached, "--cache", "none"], "bare": [bare]}.items():
        code, out, err = run_dmap("run", "-d", args[0], "-p", "a fox", *STEPS, *args[1:], "-o", tmp_path / f"{name}.png",
                                  "--json")
        assert code == 0, err
        assert "step_cache" not in json.loads(out), out
    assert (tmp_path / "none.png").read_bytes() == (tmp_path / "bare.png").read_bytes()
    assert "step_cache" not in read_metadata(tmp_path / "none.png")
    image = cached_run[1]
    assert read_metadata(image)["step_cache"].startswith("taylorseer:")
    assert image.read_bytes() != (tmp_path / "bare.png").read_bytes()  # the cache changes pixels
