"""The options and arguments that more than one command takes, each declared once.

A command names one of these aliases as the type of its parameter and keeps its own default in the
signature (`height: HeightOpt = None`), so that the flag, its short form and its help text are the
same in every command that takes it and cannot drift apart (`tests/test_cli_options.py` checks it).
Where one flag means different things to different commands (`--output` is a plan file for `plan`,
an image for `run`, a folder for `shard` and `demo`), the variants are declared here side by side,
each with the text true for its command. Options only one command takes stay in that command's module.
"""

from __future__ import annotations

from typing import Annotated

import typer

from dm_cli.planning.modes import Mode, Parallel, Word
from dm_cli.units import shorten


def word_parser(vocabulary: type[Word], flag: str):
    """Typer's parser for an option that takes one of a mode's words (dm_cli.planning.modes): the member, or one
    sentence naming them all, while the command line is parsed (Typer's own Enum message is two)."""
    def parse(text: str) -> Word:
        try:
            return vocabulary(text)
        except ValueError:
            words = vocabulary.words()
            raise typer.BadParameter(f"{flag} must be {', '.join(words[:-1])} or {words[-1]}, not "
                                     f"{shorten(text, quote=True)}.") from None

    return parse


# ---- SOURCE (arguments) ----------------------------------------------------------------------

_SOURCE_HELP = "Pipeline/component folder, .safetensors, index JSON, preset or Hub repo id."

SourceArg = Annotated[str, typer.Argument(metavar="SOURCE", help=_SOURCE_HELP)]
"""`dmap plan` and `dmap inspect`: anything dmap can read a model from."""

RunSourceArg = Annotated[str | None, typer.Argument(
    metavar="SOURCE", help="Pipeline folder, preset or Hub repo id (default: the bundled random-weight FLUX demo).")]
"""`dmap run`: a whole pipeline, optional (the demo without it)."""

ShardSourceArg = Annotated[str, typer.Argument(
    metavar="SOURCE", help="Pipeline/component folder, .safetensors or .bin file, or index JSON (--to-diffusers: a "
                           "single .safetensors or .gguf file).")]
"""`dmap shard`: weights on disk (no presets or Hub ids: there is nothing to rewrite)."""

# ---- devices and planning ------------------------------------------------------------------

MaxMemoryOpt = Annotated[str | None, typer.Option(
    "--max-memory", "-m", help="Devices to plan for, e.g. 0=16GB,1=16GB,cpu=64GB,disk (default: this machine).")]

ModeOpt = Annotated[Mode, typer.Option(
    "--mode", parser=word_parser(Mode, "--mode"), help="auto | resident (all loaded at once) | staged (per stage), for the plan made here.")]

OverheadOpt = Annotated[str | None, typer.Option(
    "--overhead", help="Per-device overhead for the plan made here, e.g. 0=600MB,1=600MB "
                       "(default 600MB per GPU, 0 for cpu).")]

ComponentOpt = Annotated[str | None, typer.Option("--component", "-c", help="Only this component.")]

# ---- what the pipeline is asked for --------------------------------------------------------

ImageOpt = Annotated[list[str] | None, typer.Option(
    "--image", metavar="PATH", help="An input image (editing, references, image-to-video); repeat for several, in order. "
                                    "LTX-2 keyframes: PATH@FRAME[:STRENGTH] conditions that video frame.")]
_HEIGHT_HELP = "Height in pixels (default: the pipeline's, e.g. 1024 for FLUX, 480 for Wan)"
HeightOpt = Annotated[int | None, typer.Option("--height", help=f"{_HEIGHT_HELP}.")]
"""`dmap run` and `dmap serve`."""

PlanHeightOpt = Annotated[int | None, typer.Option(
    "--height", help=f"{_HEIGHT_HELP}; 0 = weights only (no activations, no GPU overhead unless --overhead).")]
"""`dmap plan`: the same option, with the weights-only plan only it makes."""

WidthOpt = Annotated[int | None, typer.Option(
    "--width", help="Width in pixels (default: the pipeline's).")]

_NUM_IMAGES_HELP = "Images per prompt (dmap run writes out-0.png, out-1.png, ...; default 1, or the plan file's)."

NumImagesOpt = Annotated[int | None, typer.Option("--num-images", help=_NUM_IMAGES_HELP)]
"""`dmap plan`: no bound here, the core refuses 0 with its own message (exit 2)."""

RunNumImagesOpt = Annotated[int | None, typer.Option("--num-images", min=1, help=_NUM_IMAGES_HELP)]
"""`dmap run`: the same option, bounded by click (min=1) as it always was."""

# --prompt: what dmap run draws; what dmap plan predicts the time of (its text length)
PromptOpt = Annotated[str | None, typer.Option("--prompt", "-p", help="What to draw.")]
PlanPromptOpt = Annotated[str | None, typer.Option(
    "--prompt", "-p", help="The prompt the predicted time is for (Qwen-Image and Z-Image run its own length; default: "
                           "the longest text).")]
NegativePromptOpt = Annotated[str | None, typer.Option(
    "--negative-prompt", help="What to avoid (CFG and true-CFG pipelines).")]
GuidanceScaleOpt = Annotated[float | None, typer.Option(
    "--guidance-scale", help="Guidance (CFG) scale (default: the pipeline's).")]

MaxSequenceLengthOpt = Annotated[int | None, typer.Option(
    "--max-sequence-length", help="T5/LLM prompt tokens (FLUX, SD3, Wan, Qwen-Image; default: the pipeline's).")]

FramesOpt = Annotated[int | None, typer.Option(
    "--frames", help="Video pipelines: frames to generate, 4k+1 for Wan (default: the pipeline's, 81).")]

FpsOpt = Annotated[int | None, typer.Option(
    "--fps", help="Video pipelines: frames per second of the video (default: the pipeline's, 16 for Wan).")]

# ---- dtypes and weight storage -------------------------------------------------------------

DtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="Compute dtype: bf16 | fp16 | fp32 (default: as stored, bf16 for configs, or a plan file's).")]
"""The compute dtype `inspect` sizes at and `plan` and `run` plan and run at."""

ShardDtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="Convert floating tensors to bf16|fp16|fp32, or fp8: the layers layerwise casting stores in "
                    "float8_e4m3fn (norms, embeddings, modulation and a pipeline's VAE keep their dtype).")]
"""`dmap shard`: a conversion of the files written, not a compute dtype."""

WeightsOpt = Annotated[str | None, typer.Option(
    "--weights", "-w", help="Weights stored as fp8 | int8 and computed in --dtype (every component but the VAE), "
                            "or per component: transformer=fp8,text_encoder=fp8 (default: as stored, or a plan file's).")]

# ---- outputs -------------------------------------------------------------------------------

StepsOpt = Annotated[int | None, typer.Option("--steps", min=1, help="Denoising steps (default: the pipeline's).")]
ServeStepsOpt = Annotated[int | None, typer.Option(
    "--steps", min=1, help="Denoising steps of a request that gives none (default: the pipeline's).")]

ProfileOutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="Write the profile here (default: dmap's cache, which dmap plan reads).")]

PlanOutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="Write the plan JSON (dmap-plan v1; v2 when a decode is tiled) here.")]

RunOutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="Image to write, in the format its suffix names: .png (default dmap.png), .jpg/.jpeg or "
                           ".webp (prompt, seed and plan in its metadata); videos: out.mp4 (the default dmap.mp4), "
                           "out.webp, out.gif or a folder out/ of PNG frames, each with a JSON sidecar; with "
                           "--prompts the folder (default dmap-out).")]

ShardOutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="Folder to create (default: SOURCE-sharded beside it).")]

DemoOutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="The pipeline folder to write (a new folder, or --overwrite; default: PRESET, here).")]

OverwriteOpt = Annotated[bool, typer.Option(
    "--overwrite", help="Replace the output if it exists (only ever what dmap writes); for dmap run also "
                        "--save-latents, and with --prompts: --no-resume.")]

# ---- seeds ---------------------------------------------------------------------------------

RunSeedOpt = Annotated[int, typer.Option("--seed", help="Random seed, 0 to 2^64-1: same seed, same image.")]

DemoSeedOpt = Annotated[int, typer.Option(
    "--seed", help="Seed of the random weights (same seed and library versions, same bytes).")]

# ---- what is printed -----------------------------------------------------------------------

JsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print JSON instead of tables: stdout carries only the JSON document.")]

QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No tables nor progress: only warnings, errors and what was written where.")]

BinaryOpt = Annotated[bool, typer.Option("--binary", help="Print sizes in GiB instead of GB.")]

NoCacheOpt = Annotated[bool, typer.Option(
    "--no-cache", help="Rebuild skeletons (and, for dmap plan, traces) instead of using the cache.")]

PipelineOpt = Annotated[str | None, typer.Option(
    "--pipeline", help="SOURCE is a single file (original-layout .safetensors or .gguf) holding one component: the "
                       "rest of the pipeline (plan: a preset or a folder; run: a folder with weights; shard "
                       "--to-diffusers: a preset or folder whose first matching component's config the file takes, "
                       "default the preset dmap recognizes it as).")]

ComponentFileOpt = Annotated[list[str] | None, typer.Option(
    "--component-file", metavar="COMPONENT=FILE", help="This component from this single file (original-layout "
                                                       ".safetensors or .gguf), e.g. transformer_2=low_noise.gguf "
                                                       "for Wan 2.2's second expert; repeatable.")]

LoraOpt = Annotated[list[str] | None, typer.Option(
    "--lora", metavar="[COMPONENT=]FILE[:SCALE]", help="A LoRA adapter (diffusers/peft .safetensors) for the denoiser, "
                                                       "at SCALE (default 1.0); Wan 2.2's second expert: "
                                                       "transformer_2=FILE; repeatable.")]

CacheOpt = Annotated[str | None, typer.Option(
    "--cache", metavar="NAME[:KEY=VALUE,...]", help="A step cache on the denoiser, diffusers' hooks: fbc (First-Block "
                                                   "Cache), taylorseer or magcache, e.g. fbc:threshold=0.05; the plan "
                                                   "counts what it holds per device (run: default the plan file's; none "
                                                   "runs the plan file without its cache).")]

LastImageOpt = Annotated[str | None, typer.Option(
    "--last-image", metavar="PATH", help="The video's last frame (Wan 2.2 image-to-video from a first and a last "
                                         "frame, with --image); for dmap plan a path or its size WxH.")]

SimulateOpt = Annotated[bool, typer.Option(
    "--simulate", help="Run every planned device on this CPU with the split check (plans for GPUs you lack).")]
GpusPerRankOpt = Annotated[int | None, typer.Option(
    "--gpus-per-rank", min=0, help="Under torchrun: local rank r uses GPUs r*K .. r*K+K-1 of its node.")]
_PARALLEL_HELP = "How torchrun ranks share each denoising step: none | cfg | context | cfg+context | pipeline | auto"
ParallelOpt = Annotated[Parallel | None, typer.Option(
    "--parallel", parser=word_parser(Parallel, "--parallel"),
    help=f"{_PARALLEL_HELP} (under torchrun; default the plan file's 'parallel', else none).")]
"""`dmap run` and `dmap serve`: how this launch's ranks share each step."""

PlanParallelOpt = Annotated[Parallel | None, typer.Option(
    "--parallel", parser=word_parser(Parallel, "--parallel"),
    help=f"{_PARALLEL_HELP} (for --world-size: default none for one rank, auto above).")]
"""`dmap plan`: the layout recorded for --world-size ranks."""


# ---- the families' own settings (dm_cli.families.Setting) -----------------------------------------

_WITH_SETTINGS: list = []  # the commands wrapped by with_family_settings, refreshed by refresh_family_options


def with_family_settings(command):
    """`command(..., settings: dict)` as a Typer command with one option per setting the registered families
    declare (`--true-cfg-scale`, `--guidance-scale-2`, ...) in place of `settings`: a family's new setting
    becomes an option of `dmap plan` and `dmap run` with no edit here."""
    import functools

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from dm_cli.families import all_settings

        settings = {name: kwargs.pop(name) for name in list(kwargs) if name in all_settings()}
        return command(*args, settings={k: v for k, v in settings.items() if v is not None}, **kwargs)

    wrapper.__wrapped_command__ = command
    _WITH_SETTINGS.append(wrapper)
    _refresh(wrapper)
    return wrapper


def refresh_family_options() -> None:
    """The settings options as the family registry has them now (a test may register a family)."""
    for wrapper in _WITH_SETTINGS:
        _refresh(wrapper)


def _refresh(wrapper) -> None:
    import inspect
    import typing

    from dm_cli.families import all_settings

    command = wrapper.__wrapped_command__
    hints = typing.get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=hints.get(p.name, p.annotation))
           for p in inspect.signature(command).parameters.values() if p.name != "settings"]
    extra = [inspect.Parameter(s.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                               annotation=Annotated[s.type | None, typer.Option(s.flags, help=s.help)])
             for s in all_settings().values()]
    wrapper.__signature__ = inspect.Signature(own + extra, return_annotation=inspect.Signature.empty)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
