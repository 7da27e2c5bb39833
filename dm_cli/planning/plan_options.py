"""What `make_plan` is asked (PlanOptions), and the placement search run with those options."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from dm_cli.inputs import Generation, InputImage, InputSpec, PlacementSpec, StepCache
from dm_cli.planning.parallel.parallel import ParallelRequest
from dm_cli.planning.placement.placement import NoFit, Placement
from dm_cli.planning.placement.search import plan_pipeline
from dm_cli.planning.time.plan_prediction import PredictionRequest


@dataclass
class PlanOptions:
    """What `make_plan` is asked: where (the placement), for what (the inputs), and how to work."""

    placement: PlacementSpec = field(default_factory=PlacementSpec)  # devices, strategy, mode, overhead, dtype, weights
    inputs: InputSpec = field(default_factory=InputSpec)
    component: str | None = None  # plan one component only
    check: bool = True
    use_cache: bool = True
    on_progress: Callable[[str], None] | None = None  # hears each step (resolving, sizing, each trace, the check)
    settings: dict = field(default_factory=dict)  # the family's own (Family.settings): checked as dmap run checks them
    negative_prompt: str | None = None  # checked as dmap run checks it (FLUX refuses one); true CFG is planned anyway
    parallel: ParallelRequest = field(default_factory=ParallelRequest)  # --world-size, --parallel (planning/parallel/parallel.py)
    pipeline: str | None = None  # --pipeline: SOURCE is a single file, the rest of the pipeline comes from here
    # --component-file: (component, file) pairs, these components from these single files
    component_files: tuple[tuple[str, str], ...] = ()
    loras: tuple = ()  # LoRA adapters (dm_cli.inputs.LoraAdapter, --lora): their bytes beside the layers they patch
    # the LoRAs stay unfused, switchable per image: `dmap serve`'s requests (and a queue's items) choose among them
    switch_loras: bool = False
    cache: StepCache | None = None  # --cache: a step cache on the denoiser, its state counted (planning/step_cache.py)
    prediction: PredictionRequest = field(default_factory=PredictionRequest)  # --profile, --steps, --queue
    # the plan's devices include a GPU: activations as its kernels hold them (gpu_kernels.py); set by make_plan
    on_gpu: bool = False

    @classmethod
    def of(cls, generation: Generation, placement: PlacementSpec, **rest) -> "PlanOptions":
        """Options for one generation, so that `dmap plan`, the API and `dmap run`'s inline plan cannot drop
        one of its settings (`with_generation`)."""
        return cls(placement, **rest).with_generation(generation)

    def with_generation(self, generation: Generation) -> "PlanOptions":
        """These options for `generation`: its inputs, its family settings and its negative prompt, all three
        read from the one Generation (the inverse of `generation()`)."""
        return replace(self, inputs=generation.inputs(), settings=dict(generation.settings),
                       negative_prompt=generation.negative_prompt, cache=generation.cache)

    def generation(self) -> Generation:
        """The generation these options plan for (the inverse of `with_generation`: input images as sizes only)."""
        inputs = self.inputs
        frames = inputs.image_frames[:len(inputs.image_sizes)]
        frames = (*frames, *[None] * (len(inputs.image_sizes) - len(frames)))
        return Generation(height=inputs.height, width=inputs.width, num_frames=inputs.num_frames, fps=inputs.fps,
                          guidance_scale=inputs.guidance_scale, max_sequence_length=inputs.max_sequence_length,
                          num_images=inputs.num_images, batch_size=inputs.batch_size,
                          negative_prompt=self.negative_prompt,
                          images=tuple(InputImage(w, h, frame=frame) for (w, h), frame in zip(inputs.image_sizes, frames)),
                          last_image=InputImage(*inputs.last_image_size) if inputs.last_image_size else None,
                          cache=self.cache).with_settings(self.settings)


def place_or_none(specs, stages, devices, options: PlanOptions) -> Placement | None:
    """plan_pipeline, None where nothing fits: the tiling choice and the suggestions try many variants."""
    try:
        return plan_pipeline(specs, stages, devices, options.placement.strategy, options.placement.mode)
    except NoFit:
        return None
