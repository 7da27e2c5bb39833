"""Golden output of the inspect, plan and run renderers on fixed inputs, at 80 and 120 columns.

The inputs are fixed documents (tests/golden/*.json: FLUX.1-dev's `inspect --json` with a module
tree, and a staged FLUX plan at 512x512 on two 12 GB GPUs that splits and offloads) and a
hand-written run result; the output is Rich's, on a console COLUMNS wide, compared with
tests/golden/<name>.txt. After an intended change to a renderer, rewrite the goldens and review
their diff:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_render_golden.py
"""

import difflib
import json
import os
from pathlib import Path

import pytest

from dm_cli.model.inspection import ComponentReport, InspectReport
from dm_cli.model.skeleton import ModuleSize
from dm_cli.planning.plan_file import Plan

GOLDEN = Path(__file__).parents[1] / "golden"
WIDTHS = (80, 120)


def inspect_report() -> InspectReport:
    data = json.loads((GOLDEN / "inspect_flux.json").read_text())
    components = []
    for c in data["components"]:
        block = c["largest_block"]
        components.append(ComponentReport(
            c["name"], c["library"], c["class"], c["dtype"], c["params"], c["bytes"], c["buffers_bytes"],
            c["num_blocks"], block and ModuleSize(block["name"], block["class"], 0, block["bytes"], True, []),
            c["no_split_modules"], c["weights"], c["tree"], c["problems"]))
    return InspectReport(data["source"], data["kind"], data["pipeline_class"], data["dtype"], components,
                         data["notes"])


def flux_plan() -> Plan:
    return Plan.from_json(json.loads((GOLDEN / "plan_flux_512.json").read_text()))


def run_result():
    from dm_cli.families import Job
    from dm_cli.inputs import Generation
    from dm_cli.run.loops.stages import StageResult
    from dm_cli.run.sessions.single import RunResult

    MB = 10**6
    stages = [
        StageResult("encode", ["text_encoder", "text_encoder_2"], 3.21, 0.42, 3.63, measured_peak={"0": 9_655 * MB},
                    planned_peak={"0": 10_399 * MB}, load_rss_delta=412 * MB, tracked="all"),
        StageResult("denoise", ["transformer"], 11.02, 95.5, 106.52,
                    measured_peak={"0": 11_210 * MB, "1": 11_402 * MB, "cpu": 2_303 * MB},
                    planned_peak={"0": 11_960 * MB, "1": 11_992 * MB, "cpu": 2_303 * MB}, load_rss_delta=96 * MB,
                    tracked="first 2 of 28 steps"),
        StageResult("decode", ["vae"], 0.31, 1.9, 2.21, measured_peak={"0": 1_204 * MB},
                    planned_peak={"0": 1_563 * MB}, load_rss_delta=12 * MB, tracked="all"),
    ]
    return RunResult(source="flux", pipeline_class="FluxPipeline", demo=False, plan=flux_plan(),
                     plan_digest="5d41402abc4b2a76", planned_here=True, simulate=True,
                     job=Job.of(Generation(steps=28, guidance_scale=3.5, height=512, width=512, num_images=1), "", 0),
                     images=["fox.png"], latents_path=None, stages=stages, split_check=True)


def draw_inspect():
    from dm_cli.render.inspect import render_inspect

    render_inspect(inspect_report())


def draw_plan():
    from dm_cli.render.plan import render_plan

    render_plan(flux_plan(), output="plan.json")


def png_file(path: Path, width: int, height: int, nbytes: int) -> None:
    """A PNG of `nbytes` bytes whose header says width x height (an IDAT of zeros: enough for a header read)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    head = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    end = chunk(b"IEND", b"")
    path.write_bytes(head + chunk(b"IDAT", bytes(nbytes - len(head) - len(end) - 12)) + end)


def draw_run():
    from dm_cli.render.run import RunView

    png_file(Path("fox.png"), 512, 512, 389_421)  # in the test's own folder (cwd)
    with RunView() as view:
        view.summary(run_result())


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name,draw", [("inspect", draw_inspect), ("plan", draw_plan), ("run", draw_run)])
def test_renderer_output_matches_its_golden(name, draw, width, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.setattr("dm_cli.run.request.cuda_devices_without_torch", lambda: 0)  # no GPU: Next says --simulate
    for variable in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "NO_COLOR", "JUPYTER_COLUMNS", "LINES"):
        monkeypatch.delenv(variable, raising=False)
    capsys.readouterr()
    draw()
    captured = capsys.readouterr()
    text = captured.out + (f"--- stderr ---\n{captured.err}" if captured.err else "")
    assert "\x1b[" not in text  # not a terminal: plain text
    too_wide = [line for line in text.splitlines() if len(line) > width]
    assert not too_wide, f"lines wider than {width} columns: {too_wide[:3]}"
    path = GOLDEN / f"{name}_{width}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
        return
    assert path.is_file(), f"no golden {path.name}: run with UPDATE_GOLDEN=1 and review it"
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), path.name, "now"))
        pytest.fail(f"{path.name} changed (UPDATE_GOLDEN=1 to accept an intended change):\n{diff}")
