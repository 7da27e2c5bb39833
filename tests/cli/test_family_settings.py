"""A family's own setting, declared once in its module, reaches every door: `dmap run --help` and `dmap plan
--help`, the Python API, queue JSONL items, the pipeline's __call__ and the image metadata (the resume key).

The family here is test-only: the FLUX family with one more setting, `--flux-true-cfg`, passed to
FluxPipeline's own `true_cfg_scale`. Registering it is the only step; nothing outside this module changes.
"""

from __future__ import annotations

import pytest
from conftest import run_dmap

from dm_cli.families import Setting
from dm_cli.families.flux import FluxFamily


class FluxTestFamily(FluxFamily):
    name = "flux-test"
    settings = (Setting("flux_true_cfg", float, None, "Test-only: FluxPipeline's true_cfg_scale.",
                        argument="true_cfg_scale", for_whom="the test family", instead="drop it"),)


@pytest.fixture()
def registered(monkeypatch):
    import dm_cli.families as families

    original = families.all_families()
    monkeypatch.setattr(families, "all_families", lambda: (FluxTestFamily(), *original))


def test_the_setting_is_an_option_of_plan_and_run(registered):
    for command in ("run", "plan"):
        code, out, _ = run_dmap(command, "--help")
        assert code == 0 and "--flux-true-cfg" in out and "Test-only: FluxPipeline's true_cfg_scale." in " ".join(out.split())


def test_the_setting_is_a_queue_key(registered, tmp_path):
    from dm_cli.run.sessions.queue import read_prompts

    path = tmp_path / "q.jsonl"
    path.write_text('{"prompt": "a fox", "flux_true_cfg": 2}\n{"prompt": "a cat"}\n')
    first, second = read_prompts(path)
    assert first.settings == (("flux_true_cfg", 2.0),) and second.settings == ()
    path.write_text('{"prompt": "a fox", "flux_true_cfg": "high"}\n')
    with pytest.raises(Exception, match="'flux_true_cfg' must be a number"):
        read_prompts(path)


def test_the_setting_reaches_the_pipeline_and_the_metadata_through_the_api_and_the_cli(registered, tmp_path,
                                                                                      monkeypatch):
    pytest.importorskip("torch")
    import functools

    import diffusers
    from PIL import Image

    import dm_cli

    seen = []
    original = diffusers.FluxPipeline.__call__

    @functools.wraps(original)  # the stage loop reads __call__'s signature
    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("true_cfg_scale"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(diffusers.FluxPipeline, "__call__", spy)
    with dm_cli.load(None, max_memory="cpu=8GB") as pipe:
        generated = next(pipe.generate("a fox", steps=1, flux_true_cfg=2.5))
    assert seen == [2.5] and generated.metadata["flux_true_cfg"] == "2.5"
    out = tmp_path / "fox.png"
    code, _, err = run_dmap("run", "--prompt", "a fox", "--steps", "1", "--flux-true-cfg", "3", "-o", out, "-q")
    assert code == 0, err
    with Image.open(out) as image:
        assert image.text["flux_true_cfg"] == "3.0" and seen[-1] == 3.0


def test_another_family_refuses_it_in_one_sentence(registered, tmp_path):
    code, _, err = run_dmap("plan", "tiny-sd15", "--flux-true-cfg", "2", "-q", "-m", "cpu=8GB")
    assert code == 2 and "--flux-true-cfg is for the test family, not Stable Diffusion: drop it." in err, err


def test_the_real_families_settings_are_queue_keys_too(tmp_path):
    """Qwen-Image's true_cfg_scale and Wan 2.2's guidance_scale_2 travel in queue items like any setting."""
    from dm_cli.run.sessions.queue import read_prompts

    path = tmp_path / "q.jsonl"
    path.write_text('{"prompt": "a fox", "true_cfg_scale": 2.5, "guidance_scale_2": 3}\n')
    (item,) = read_prompts(path)
    assert item.settings == (("guidance_scale_2", 3.0), ("true_cfg_scale", 2.5))
