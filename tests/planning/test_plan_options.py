"""PlanOptions holds the generation once (`PlanOptions.generation`): no field of its own restates a setting of
`dm_cli.inputs.Generation`, so `dmap plan`, the API and `dmap run`'s inline plan cannot drift apart on one."""

from __future__ import annotations

from dataclasses import fields

from dm_cli.inputs import Generation, InputImage, InputSpec, PlacementSpec, StepCache
from dm_cli.planning.plan_options import PlanOptions


def test_no_field_restates_a_generation_setting():
    restated = {f.name for f in fields(Generation)} | {"inputs", "settings", "negative_prompt"}
    assert not {f.name for f in fields(PlanOptions)} & restated  # its LoRAs too: `loras` reads the generation's
    assert [f.name for f in fields(PlanOptions)][:2] == ["placement", "generation"]


def test_of_stores_the_generation_itself():
    generation = Generation(height=64, width=96, num_frames=9, images=(InputImage(32, 48, frame=0),),
                            negative_prompt="blur", cache=StepCache("fbc")).with_settings({"max_area": 4096})
    options = PlanOptions.of(generation, PlacementSpec("cpu=1GB"), check=False)
    assert options.generation is generation and options.check is False
    assert options.inputs == generation.inputs()
    assert options.settings == {"max_area": 4096}
    assert options.negative_prompt == "blur" and options.cache == StepCache("fbc")


def test_of_keeps_the_input_images_sizes_only():
    """A run's files (path, digest) are the run's: the plan sees each image's size and frame."""
    image = InputImage(32, 48, path="/tmp/ref.png", digest="abc", frame=0, strength=0.5)
    options = PlanOptions.of(Generation(images=(image,), last_image=InputImage(16, 16, path="/tmp/last.png")),
                             PlacementSpec())
    assert options.generation.images == (InputImage(32, 48, frame=0, strength=0.5),)
    assert options.generation.last_image == InputImage(16, 16)


def test_default_plans_what_inputspec_defaults_to():
    assert PlanOptions().inputs == InputSpec()
    assert PlanOptions().settings == {} and PlanOptions().negative_prompt is None and PlanOptions().cache is None
