"""`dmap run` planning inline settles exactly what `dmap plan -o` then `dmap run -d` settle: the same plan JSON,
the same metadata, the same pixels, for every family and every setting a family declares.

Both paths build their planner options from one settled Generation (`PlanOptions.of`); a setting that one path
forgot (FLUX.1 Kontext's --max-area, issue 31) fails here. Each case runs the tiny twin with random weights,
planned for the CPU, in this process.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_dmap

from dm_cli.families import all_families
from dm_cli.model.sources import PRESETS_DIR

pytestmark = pytest.mark.filterwarnings("ignore")

DEVICES = ("--max-memory", "cpu=8GB")
SMALL = ("--height", "32", "--width", "32")
VIDEO = ("--frames", "5", *SMALL)
# family -> (tiny preset, the arguments it needs, whether it makes videos)
FAMILY_CASES = {
    "sd3": ("tiny-sd3", SMALL, False),
    "sdxl": ("tiny-sdxl", SMALL, False),
    "sd15": ("tiny-sd15", SMALL, False),
    "flux2": ("tiny-flux2", SMALL, False),
    # the tiny twin at 32x48 (the default 1024x1024 would take a minute): --max-area keeps that size; no reference
    # (the pipeline's auto-resize would encode it at 1248x832, a minute too), but with --no-auto-resize below
    "flux-kontext": ("tiny-flux-kontext", ("--height", "32", "--width", "48", "--max-area", "1536"), False),
    "flux-img2img": ("tiny-flux-img2img", ("--image", "{ref}", *SMALL), False),
    "flux": ("tiny-flux", SMALL, False),
    "qwen-image-edit-plus": ("tiny-qwenimage-edit", ("--image", "{ref}", "--negative-prompt", "blur", *SMALL), False),
    "qwen-image-edit": ("tiny-qwenimage-edit-single", ("--image", "{ref}", "--negative-prompt", "blur", *SMALL), False),
    "qwen-image-img2img": ("tiny-qwenimage-img2img", ("--image", "{ref}", "--negative-prompt", "blur", *SMALL), False),
    "qwen-image": ("tiny-qwenimage", ("--negative-prompt", "blur", *SMALL), False),
    "wan-i2v": ("tiny-wan-i2v", ("--image", "{ref}", *VIDEO), True),
    "wan": ("tiny-wan", VIDEO, True),
    "z-image": ("tiny-zimage", SMALL, False),
    "ltx-2": ("tiny-ltx2", VIDEO, True),
}
# QwenImageEdit(Plus)Pipeline encodes its input image at about 1024x1024 whatever the output size (a minute a run
# on the CPU): these cases stop after planning and settling, and compare the plans only
PLAN_ONLY = {"qwen-image-edit-plus", "qwen-image-edit"}
STOPPED = 77
# every declared setting -> a value other than its default that the case above runs with
SETTING_VALUES = {
    ("flux-kontext", "max_area"): 2048,  # with SETTING_ARGS' 32x64, a size the pipeline's resize keeps
    ("flux-kontext", "auto_resize"): False,
    ("flux-img2img", "strength"): 0.8,
    ("qwen-image-edit-plus", "true_cfg_scale"): 2.5,
    ("qwen-image-edit", "true_cfg_scale"): 2.5,
    ("qwen-image-img2img", "true_cfg_scale"): 2.5,
    ("qwen-image-img2img", "strength"): 0.8,
    ("qwen-image", "true_cfg_scale"): 2.5,
    ("wan-i2v", "guidance_scale_2"): 2.0,
    ("wan", "guidance_scale_2"): 2.0,
    ("ltx-2", "frame_rate"): 12.0,
    ("ltx-2", "image_crf"): 20,
}

# the arguments of a setting's case, instead of its family's
SETTING_ARGS = {("flux-kontext", "max_area"): ("--height", "32", "--width", "64"),
                ("flux-kontext", "auto_resize"): ("--image", "{ref}", "--height", "32", "--width", "48", "--max-area", "1536")}


def _cases():
    cases = []
    for family in all_families():
        cases.append(pytest.param(family.name, None, id=f"{family.name}-defaults"))
        cases += [pytest.param(family.name, s.name, id=f"{family.name}-{s.name}") for s in family.settings]
    return cases


def test_every_family_and_setting_has_a_case():
    """A new family or setting must be added here (a case the comparison below runs)."""
    families = {f.name: f for f in all_families()}
    assert set(FAMILY_CASES) == set(families)
    assert set(SETTING_VALUES) == {(f.name, s.name) for f in families.values() for s in f.settings}


def _flags(family_name: str, setting: str | None) -> list[str]:
    if setting is None:
        return []
    value = SETTING_VALUES[(family_name, setting)]
    flag = "--" + setting.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else f"--no-{flag[2:]}"]
    return [flag, str(value)]


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    root, written = tmp_path_factory.mktemp("inline-plan"), {}

    def folder(preset: str):
        if preset not in written:
            written[preset] = write_random_pipeline(PRESETS_DIR / preset, root / preset, seed=0)
        return written[preset]

    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from PIL import Image

    path = tmp_path_factory.mktemp("reference") / "ref.png"
    Image.new("RGB", (48, 32), (30, 160, 90)).save(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family_name,setting", _cases())
def test_inline_plan_settles_what_plan_then_run_settles(family_name, setting, pipelines, reference, tmp_path,
                                                       monkeypatch):
    pytest.importorskip("torch")
    import dm_cli.run.settle.checks as checks_module
    from dm_cli.io.outputs import read_metadata

    preset, needed, video = FAMILY_CASES[family_name]
    folder = pipelines(preset)
    needed = SETTING_ARGS.get((family_name, setting), needed)
    args = [a.format(ref=reference) for a in needed] + _flags(family_name, setting)
    planned = []
    real = checks_module.make_run_plan
    monkeypatch.setattr(checks_module, "make_run_plan", lambda *a, **k: planned.append(real(*a, **k)) or planned[-1])
    # a frames folder whose name holds dots (issue 31: a trailing / names a folder)
    outputs = [tmp_path / ("inline.v0.5" if video else "inline.png"), tmp_path / ("filed.v0.5" if video else "filed.png")]
    given = [str(path) + ("/" if video else "") for path in outputs]  # Path drops a trailing slash
    run = ["run", folder, "--prompt", "a fox", "--steps", "2", "--seed", "3", "--quiet", *args]
    expected = 0
    if family_name in PLAN_ONLY:
        import dm_cli.run.loops.stages as stages

        def stop(*_, **__):
            raise SystemExit(STOPPED)

        monkeypatch.setattr(stages.StageLoop, "run_jobs", stop)
        expected = STOPPED

    code, _, err = run_dmap(*run, *DEVICES, "--output", given[0])
    assert code == expected, err
    code, _, err = run_dmap("plan", folder, *DEVICES, *args, "--steps", "2", "--output", tmp_path / "plan.json",
                            "--quiet")  # the run's steps: the plan records them for `run -d`
    assert code == 0, err
    code, _, err = run_dmap(*run, "--device-map", tmp_path / "plan.json", "--output", given[1])
    assert code == expected, err

    assert len(planned) == 1  # the run with --device-map planned nothing
    assert planned[0].to_json() == json.loads((tmp_path / "plan.json").read_text())
    if family_name in PLAN_ONLY:
        return
    inline, filed = (read_metadata(path) for path in outputs)
    assert inline == filed
    if setting is not None:
        assert inline[setting] == str(SETTING_VALUES[(family_name, setting)])
    if video:
        names = sorted(p.name for p in outputs[0].iterdir())
        assert names == sorted(p.name for p in outputs[1].iterdir()) and "metadata.json" in names
        assert all((outputs[0] / n).read_bytes() == (outputs[1] / n).read_bytes() for n in names)
    else:
        assert outputs[0].read_bytes() == outputs[1].read_bytes()
