"""One generation, one rule: `dm_cli.plan` accepts a generation exactly when `dm_cli.load` and `dmap run` do,
with the same sentence when they refuse (`Family.settle` and `Family.validate` are the one place).

The property runs over every registered family, on a copy of its tiny twin's configs (no weights, not a preset).
Everything after the rules (sizing, tracing, loading weights) is replaced by a sentinel that says "accepted",
so each example costs milliseconds: what is compared is the decision and its message.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import run_dmap
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dm_cli
from dm_cli.errors import UsageError
from dm_cli.families import all_families, all_settings
from dm_cli.model.sources import PRESETS_DIR

# one tiny twin per registered family (the test fails when a family is added without one)
TWINS = {"flux": "tiny-flux", "flux2": "tiny-flux2", "qwen-image": "tiny-qwenimage", "sd15": "tiny-sd15",
         "sd3": "tiny-sd3", "sdxl": "tiny-sdxl", "wan": "tiny-wan", "wan-i2v": "tiny-wan-i2v",
         "z-image": "tiny-zimage", "flux-kontext": "tiny-flux-kontext", "flux-img2img": "tiny-flux-img2img",
         "ltx-2": "tiny-ltx2", "qwen-image-edit-plus": "tiny-qwenimage-edit", "qwen-image-edit": "tiny-qwenimage-edit-single",
         "qwen-image-img2img": "tiny-qwenimage-img2img"}
ACCEPTED = "accepted: the rules let this generation through"


class Accepted(Exception):
    pass


def test_every_family_has_a_twin_here():
    assert {family.name for family in all_families()} == set(TWINS)


@pytest.fixture(scope="module")
def twin_folders(tmp_path_factory):
    """Config-only copies of the tiny twins: resolved like a user's folder (a preset refuses dmap run first)."""
    root = tmp_path_factory.mktemp("twins")
    folders = {}
    for family, preset in TWINS.items():
        folders[family] = root / preset
        shutil.copytree(PRESETS_DIR / preset, folders[family])
    return folders


@pytest.fixture()
def accepting(monkeypatch):
    """Past the rules, plan and load stop with Accepted: plan before it reads the devices, load before it opens
    a weight file (the first thing either does after the generation is settled and checked)."""
    def accept(*args, **kwargs):
        raise Accepted(ACCEPTED)

    monkeypatch.setattr("dm_cli.planning.make.parse_device_spec", accept)
    monkeypatch.setattr("dm_cli.run.settle.checks.check_component_files", accept)


def _outcome(call) -> str:
    try:
        call()
    except Accepted:
        return ACCEPTED
    except UsageError as error:
        return str(error)
    raise AssertionError("neither accepted nor refused")


def _setting_values(name: str):
    """Values of a setting's own type (the command line parses the type before any rule sees it)."""
    kind = all_settings()[name].type
    return {bool: st.booleans(), int: st.sampled_from([0, 1, 4096]), str: st.just("x")}.get(
        kind, st.sampled_from([1.0, 2.5, 5.0]))


# mostly what pipelines take, sometimes not: both answers are drawn often
SIZES = st.sampled_from([None, None, 16, 32, 32, 48, 64, 64, 8, 24, 50, 100, 1000])
generations = st.fixed_dictionaries({
    "height": SIZES, "width": SIZES,
    "num_frames": st.sampled_from([None, None, None, None, 1, 5, 9, 4]),
    "fps": st.sampled_from([None, None, None, 8]),
    "guidance_scale": st.sampled_from([None, 1.0, 3.5]),
    "max_sequence_length": st.sampled_from([None, 64, 256]),
    "negative_prompt": st.sampled_from([None, None, "blurry"]),
    "settings": st.one_of(st.just({}), st.just({}), st.just({}), st.lists(
        st.sampled_from(sorted(all_settings())), max_size=2, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: _setting_values(name) for name in names}))),
})


def _makes_video(name: str) -> bool:
    return next(f for f in all_families() if f.name == name).default_num_frames is not None


def _cli_args(folder, ask: dict, video: bool) -> list[str]:
    output = folder / ("never.mp4" if video else "never.png")  # never written: the run stops at the weights
    args = ["run", str(folder), "--prompt", "a fox", "--max-memory", "cpu=64GB", "-o", str(output)]
    flags = {"height": "--height", "width": "--width", "num_frames": "--frames", "fps": "--fps",
             "guidance_scale": "--guidance-scale", "max_sequence_length": "--max-sequence-length",
             "negative_prompt": "--negative-prompt"}
    for key, flag in flags.items():
        if ask[key] is not None:
            args += [flag, str(ask[key])]
    for name, value in ask["settings"].items():
        flag = all_settings()[name].flag
        args += ([flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)])
    return args


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(TWINS)), ask=generations)
def test_plan_accepts_exactly_when_load_and_run_do_with_the_same_message(family, ask, twin_folders, accepting):
    folder = twin_folders[family]
    keywords = {k: v for k, v in ask.items() if k != "settings" and v is not None}
    planned = _outcome(lambda: dm_cli.plan(str(folder), max_memory="cpu=64GB", check=False, **keywords, **ask["settings"]))
    loaded = _outcome(lambda: dm_cli.load(str(folder), max_memory="cpu=64GB", **keywords, **ask["settings"]))
    event("accepted" if planned == ACCEPTED else "refused: " + planned.split(" ")[0])
    if planned.endswith("needs an input image: add --image PATH."):
        assert loaded == ACCEPTED, (family, ask)  # load's prompts bring their images: each generate() checks them
    else:
        assert planned == loaded, (family, ask)
    code, _, err = run_dmap(*_cli_args(folder, ask, _makes_video(family)))
    if planned == ACCEPTED:
        assert ACCEPTED in err, (family, ask, err)
    else:
        assert code == 2 and " ".join(planned.split()) in " ".join(err.split()), (family, ask, planned, err)


def test_a_size_the_pipeline_refuses_is_refused_by_plan_as_by_run(twin_folders, accepting):
    """dmap plan flux --height 1000 wrote a plan that dmap run refused ("not a multiple of 16")."""
    code, _, err = run_dmap("plan", "flux", "--height", "1000", "-q")
    assert code == 2 and "--height 1000 is not a multiple of 16, which FluxPipeline needs" in err, err
    folder = twin_folders["flux"]
    planned = _outcome(lambda: dm_cli.plan(str(folder), max_memory="cpu=64GB", height=10, check=False))
    assert planned == ACCEPTED  # tiny-flux's VAE has scale 1: multiples of 2, for plan as for run
    assert _outcome(lambda: dm_cli.load(str(folder), max_memory="cpu=64GB", height=10)) == ACCEPTED


def test_an_unknown_setting_is_one_sentence_naming_the_settings(twin_folders, accepting):
    folder = twin_folders["qwen-image"]
    message = _outcome(lambda: dm_cli.load(str(folder), true_cfg=2.0))
    assert message.startswith("Unknown setting 'true_cfg'") and "true_cfg_scale" in message


def test_plan_refuses_a_negative_prompt_as_run_does(twin_folders, accepting):
    """dmap plan took no --negative-prompt, so a plan for FLUX with one was written and the run refused it."""
    code, _, err = run_dmap("plan", "flux", "--negative-prompt", "blurry", "-q")
    assert code == 2 and "ignore negative prompts" in err, err
    folder = twin_folders["qwen-image"]
    assert _outcome(lambda: dm_cli.plan(str(folder), max_memory="cpu=64GB", negative_prompt="blurry",
                                        check=False)) == ACCEPTED
