"""What the user asks a pipeline for (resolution, frames, batch, CFG, sequence length), as plain data.

Shared by the tracer (activation estimates), the planner and the runner. No torch.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace

from dm_cli.errors import UsageError
from dm_cli.units import shorten

# The largest value of each count a real run can use: beyond it a value is a typo (or an attack) that
# overflows a size, builds a billion output names or runs for years. One table for `dmap plan`,
# `dmap run`, queue items, plan files and the Python API, checked before anything loads.
LIMITS = {
    "steps": 10_000,
    "batch_size": 1024,
    "num_images": 10_000,
    "height": 16384,
    "width": 16384,
    "num_frames": 4097,  # 4 * 1024 + 1 (Wan: 4k+1)
    "fps": 1000,
    "max_sequence_length": 4096,
}
# Pixels one call of a pipeline makes (batch x images x frames x height x width): 2^32, sixteen 16384x16384
# images or about 4,660 frames of 1280x720. Each count can be within LIMITS while their product is beyond
# what any VAE decodes (its full-resolution features alone would take terabytes) and the meta trace
# of such a call runs for minutes: refused before anything is traced.
MAX_PIXELS = 2**32
# the smallest value of each (height/width 0: a weights-only plan)
LOWEST = {"height": 0, "width": 0}
FLAGS = {"num_frames": "--frames"}


def flag(name: str) -> str:
    """The command-line option of an InputSpec or run field."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def check_count(name: str, value, where: str | None = None) -> int:
    """`value` when it is a whole number from LOWEST (1) to LIMITS[name], else UsageError naming
    `where` (default: the option)."""
    low, high = LOWEST.get(name, 1), LIMITS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = shorten(value, quote=True)
        raise UsageError(f"{where or flag(name)} must be a whole number >= {low} (at most {high}), not {shown}.")
    return value


# The largest guidance (and true-CFG) scale a request may carry, and the bound of every other number a family's
# settings take: far beyond any useful value (guidance is a few to a few tens), and far inside float16's range
# (65504), the narrowest dtype a model computes in. A finite 1e308 passes `math.isfinite`, then overflows float32
# inside the model (a RuntimeError after the models load, or a 500 for every request of a served batch).
MAX_SCALE = 1000.0
SCALES = ("guidance_scale", "guidance_scale_2", "true_cfg_scale")  # guidance scales: from 0 to MAX_SCALE


def check_number(value, where: str, low: float = -MAX_SCALE, high: float = MAX_SCALE) -> float:
    """`value` as a float when it is a real number from `low` to `high` (never a bool, NaN or infinity), else
    UsageError naming `where`: the one check of every number a request carries (`dmap run`'s options, queue items,
    `dmap serve`'s JSON, the family's settings), so the three paths refuse the same value with the same sentence."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and low <= value <= high):
        finite = "finite " if isinstance(value, float) and not math.isfinite(value) else ""
        raise UsageError(f"{where} must be a {finite}number from {low:g} to {high:g}, not {shorten(value, quote=True)}.")
    return float(value)


def check_scale(value, where: str = "--guidance-scale") -> float:
    """A guidance scale (guidance_scale, true_cfg_scale, guidance_scale_2): a number from 0 to MAX_SCALE."""
    return check_number(value, where, 0.0, MAX_SCALE)


def check_text(value, where: str) -> str:
    """`value` when it is a string the tokenizers take: encodable as UTF-8, so without a lone surrogate (JSON's
    `"\\ud800"` parses in Python, a command-line argument of invalid UTF-8 arrives as one, and the tokenizer raises
    on it only after the models load). Else UsageError naming `where` and the character."""
    if not isinstance(value, str):
        raise UsageError(f"{where} must be a string, not {type(value).__name__}.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = value[error.start]
        raise UsageError(f"{where} is not valid Unicode text: character {error.start + 1} is a lone surrogate "
                         f"(\\u{ord(bad):04x}); send UTF-8 text.") from None
    return value


def check_counts(**values) -> None:
    """check_count for each given value that is not None: a run request's counts before anything loads."""
    for name, value in values.items():
        if value is not None:
            check_count(name, value)


@dataclass(frozen=True)
class InputImage:
    """An input image of a generation (a reference, the image to edit, a video's first frame), as the plan
    and the run know it: its size, and for a run the file and its digest (the metadata and the resume key
    name it, so a changed input is not "complete"). `path` None: a size only (`dmap plan --image-size`).
    Pixels are read at run time by dm_cli.io.input_images, never here."""

    width: int
    height: int
    path: str | None = None
    digest: str | None = None  # sha256 of the file's bytes (of the RGB pixels for an image given in memory)
    # an image given in memory (the API's `image=` PIL image), already RGB: read instead of `path`
    pixels: object = field(default=None, compare=False, repr=False)
    # an image file's bytes received in memory (`dmap serve`'s base64), checked when received and decoded only when
    # its batch runs, as a file is: read instead of `path` (its digest is of these bytes)
    encoded: bytes | None = field(default=None, compare=False, repr=False)
    # a keyframe (`--image PATH@FRAME[:STRENGTH]`, LTX-2 only): the video frame it conditions and how strongly
    # (None: a plain input image; the family says what a frame index means and which ones it takes)
    frame: int | None = None
    strength: float | None = None

    def __post_init__(self) -> None:
        check_count("width", self.width, "an input image's width")
        check_count("height", self.height, "an input image's height")
        if self.width < 1 or self.height < 1:
            raise UsageError(f"An input image of {self.width}x{self.height} pixels has no pixels.")
        if self.frame is not None and (isinstance(self.frame, bool) or not isinstance(self.frame, int)
                                       or not 0 <= self.frame < LIMITS["num_frames"]):
            raise UsageError(f"An input image's frame index must be a whole number from 0 to {LIMITS['num_frames'] - 1}, "
                             f"not {shorten(self.frame, quote=True)}.")
        if self.strength is not None:
            if self.frame is None:
                raise UsageError("An input image's strength goes with its frame index (PATH@FRAME:STRENGTH).")
            if isinstance(self.strength, bool) or not isinstance(self.strength, (int, float)) or not (
                    math.isfinite(self.strength) and 0 < self.strength <= 1):
                raise UsageError("A keyframe's strength must be a number above 0 and at most 1 (1: kept as given), "
                                 f"not {shorten(self.strength, quote=True)}.")

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    @property
    def label(self) -> str:
        """What the metadata and the resume key say of it: WxH:sha256, and @FRAME[:STRENGTH] for a keyframe."""
        text = f"{self.width}x{self.height}:{self.digest}"
        if self.frame is not None:
            text += f"@{self.frame}" + (f":{self.strength:g}" if self.strength is not None else "")
        return text

    def to_json(self) -> dict:
        data = {"width": self.width, "height": self.height, "path": self.path, "digest": self.digest}
        if self.frame is not None:  # only then: a plain image's record stays as it was
            data["frame"] = self.frame
            if self.strength is not None:
                data["strength"] = self.strength
        return data

    @classmethod
    def from_json(cls, data) -> "InputImage":
        if not isinstance(data, dict) or not {"width", "height"} <= set(data):
            raise UsageError("An input image must be given as {\"width\": W, \"height\": H}.")
        return cls(data["width"], data["height"], data.get("path"), data.get("digest"), frame=data.get("frame"),
                   strength=data.get("strength"))


# A LoRA's scale after the last ':' of `--lora FILE:SCALE` and of a request's or queue item's "lora": "NAME:SCALE"
_LORA_SCALE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_NOT_FINITE = ("nan", "inf", "+inf", "-inf", "infinity")
_COMPONENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_LORA_CHOICES = 64  # adapters one request or queue item may choose: more than any server loads


def lora_scale(text: str, where: str, strict: bool = False) -> tuple[str, float | None]:
    """`TEXT[:SCALE]` -> (TEXT, SCALE or None): the one reading of a LoRA's scale that `--lora FILE:SCALE`, a queue
    item's and a served request's `"lora": "NAME:SCALE"` share, so the three refuse a bad scale with one sentence.
    The part after the last ':' is the scale when it is a number, at most MAX_SCALE either way; 'nan' or 'inf' there
    (or, `strict`, any word that is not a number) is refused, naming `where`; else TEXT holds the ':' itself."""
    stem, colon, last = text.rpartition(":")
    if not colon:
        return text, None
    if _LORA_SCALE.fullmatch(last):
        scale = float(last)
        if not math.isfinite(scale):
            raise UsageError(f"{where}: the scale must be a finite number, not {last}.")
        if abs(scale) > MAX_SCALE:
            raise UsageError(f"{where}: the scale {last} is oversized: a LoRA's scale is a weight like 0.8, at most "
                             f"{MAX_SCALE:g} either way (beyond it the model's numbers overflow).")
        return stem, scale
    if strict or last.strip().lower() in _NOT_FINITE:
        raise UsageError(f"{where}: the scale after ':' must be a finite number, like 0.8, not '{shorten(last)}'.")
    return text, None


@dataclass(frozen=True)
class LoraChoice:
    """One of the adapters loaded at start (`--lora`) that a served request or a queue item chooses, as its
    `"lora"` names it: `[COMPONENT=]NAME[:SCALE]`, NAME the file's name (or its path as `--lora` gave it, or the
    name without `.safetensors`), SCALE None for the scale it was loaded with (`dm_cli.model.lora.chosen_loras`
    finds the adapter)."""

    text: str  # as given, without the scale
    scale: float | None = None

    @property
    def split(self) -> tuple[str | None, str]:
        """(COMPONENT or None, NAME): a `COMPONENT=` prefix read as one (the name is tried whole too)."""
        head, sep, rest = self.text.partition("=")
        return (head, rest) if sep and rest and _COMPONENT.fullmatch(head) else (None, self.text)

    @property
    def label(self) -> str:
        return self.text if self.scale is None else f"{self.text}:{self.scale:g}"


def lora_choices(value, where: str) -> tuple[LoraChoice, ...]:
    """A served request's or a queue item's `"lora"`: `"[COMPONENT=]NAME[:SCALE]"` or a list of them, in the order
    the adapters apply; `[]` or `"none"` for none. Checked here alike for both (the scale as `--lora`'s,
    `lora_scale`); which adapters the names are is the session's to say (what it loaded)."""
    if value == "none" or value == []:
        return ()
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) and t.strip() and len(t) <= 4096 for t in texts):
        raise UsageError(f"{where} must be \"NAME[:SCALE]\" (an adapter loaded at start), a list of them, or [] for "
                         "none.")
    if len(texts) > MAX_LORA_CHOICES:
        raise UsageError(f"{where} lists {len(texts)} adapters; at most {MAX_LORA_CHOICES} apply at once.")
    choices = []
    for text in texts:
        check_text(text, where)
        name, scale = lora_scale(text.strip(), f"{where} {shorten(text.strip())}")
        choices.append(LoraChoice(name, scale))
    return tuple(choices)


@dataclass(frozen=True)
class LoraLayer:
    """One layer a LoRA patches: its module path inside the component, the shapes of its lora_A and lora_B
    weights (checked against the layer's own weight before anything loads) and their bytes as stored."""

    module: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter (`--lora [COMPONENT=]FILE[:SCALE]`) as the plan and the run know it: the file, its sha256
    (the metadata and the resume key name it), its scale, the component it patches and the layers it patches
    (read by dm_cli.model.lora from the safetensors header; the tensors are loaded at run time by diffusers).

    `component`: the one the user named (`transformer_2=FILE`), else the one its keys name (`transformer.`,
    `unet.`), else None (bare peft keys: the pipeline's denoiser, settled by `dm_cli.model.lora.settle_targets`).
    `layers` empty: keys in a layout diffusers converts while loading (kohya, original), counted per component."""

    path: str
    digest: str
    scale: float = 1.0
    component: str | None = None
    tensors: int = 0
    stored_bytes: int = 0
    layers: tuple[LoraLayer, ...] = field(default=(), compare=False, repr=False)
    keys_component: str | None = None  # the component its key prefixes name (None: bare peft keys or a foreign layout)
    numel: int = 0  # elements of every tensor: the bytes it takes at the run dtype are numel * that dtype's size

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def key(self) -> str:
        """What changes pixels: the component it patches, the file's digest and the scale (the resume key)."""
        return f"{self.component}:{self.digest}:{self.scale:g}"

    def to_json(self) -> dict:
        return {"path": self.path, "component": self.component, "scale": self.scale, "digest": self.digest,
                "tensors": self.tensors, "stored_bytes": self.stored_bytes}


@dataclass(frozen=True)
class StepCache:
    """A step cache (`--cache NAME[:K=V,...]`): one of diffusers' cache hooks on the denoiser, with its settings as
    sorted (key, value) pairs, every default filled in (`dm_cli.planning.step_cache.parse_cache` makes one and
    knows the names, keys and bounds). It changes pixels and memory, so a Generation holds it."""

    name: str
    settings: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        """What the metadata, the resume key and the plan say of it: NAME:K=V,... (as --cache takes it)."""
        def text(value) -> str:
            return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)

        return self.name + (":" + ",".join(f"{k}={text(v)}" for k, v in self.settings) if self.settings else "")

    def setting(self, name: str, default=None):
        return dict(self.settings).get(name, default)


@dataclass(frozen=True)
class InputSpec:
    """The inputs a plan is made for. height == width == 0 means weights only (no activations).

    height/width None (only between the command line and `plan.make_plan`): the pipeline's default size.
    """

    height: int | None = 1024
    width: int | None = 1024
    batch_size: int = 1
    num_images: int = 1  # images per prompt: the models see batch_size * num_images
    guidance_scale: float | None = None  # None: the pipeline's default
    max_sequence_length: int | None = None  # None: the pipeline's default (T5 tokens)
    num_frames: int | None = None  # video pipelines: frames to generate (None: the pipeline's default; images: unused)
    fps: int | None = None  # video pipelines: frames per second of the written video (no effect on memory)
    # input images as (width, height), in order (references, the image to edit, a first and a last frame)
    image_sizes: tuple[tuple[int, int], ...] = ()
    # the last frame of a first-last-frame video (Wan 2.2 image-to-video's `last_image`), as (width, height)
    last_image_size: tuple[int, int] | None = None
    # the frame index of each input image, by position in image_sizes (LTX-2's keyframes: InputImage.frame; None:
    # a plain image); () when no image has one. Positions past image_sizes' end are ignored.
    image_frames: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        """Refuse what no pipeline can take, what no run could use (LIMITS) and what would write invalid
        JSON, such as NaN. Plan files are read through here too. The family checks what depends on the
        model (Wan's 4k+1 frames, size multiples)."""
        for name in ("height", "width", "batch_size", "num_images", "max_sequence_length", "num_frames", "fps"):
            value = getattr(self, name)
            if value is None and name not in ("batch_size", "num_images"):
                continue  # the pipeline's default, settled by the planner
            check_count(name, value)
        for frame in self.image_frames:
            if frame is not None:
                InputImage(1, 1, frame=frame)  # the same bounds as an input image's
        if self.guidance_scale is not None:
            check_scale(self.guidance_scale)
        self._check_pixels()

    def _check_pixels(self) -> None:
        """Refuse a call of more than MAX_PIXELS pixels (sizes the pipeline settles later are not counted)."""
        if self.height is None or self.width is None:
            return
        frames = self.num_frames or 1
        pixels = self.effective_batch * frames * self.height * self.width
        if pixels <= MAX_PIXELS:
            return
        what = f"{self.height}x{self.width}" + (f" x {frames} frames" if self.num_frames else "")
        if self.effective_batch > 1:
            what += f" x batch {self.effective_batch} (--batch-size x --num-images)"
        raise UsageError(f"{what} is {pixels:,} pixels in one call, more than any pipeline decodes at once "
                         f"(at most {MAX_PIXELS:,}): use a smaller size, fewer frames or fewer images.")

    @property
    def weights_only(self) -> bool:
        return self.height == 0 or self.width == 0

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.num_images

    def to_json(self) -> dict:
        data = asdict(self)
        del data["image_sizes"], data["last_image_size"], data["image_frames"]
        if self.image_sizes:  # only then: a text-to-image plan file stays as it was
            data["image_sizes"] = [list(size) for size in self.image_sizes]
        if self.last_image_size:
            data["last_image_size"] = list(self.last_image_size)
        if any(frame is not None for frame in self.image_frames):  # keyframes (LTX-2) only
            data["image_frames"] = list(self.image_frames)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "InputSpec":
        fields = {k: data[k] for k in ("height", "width", "batch_size", "num_images", "guidance_scale",
                                        "max_sequence_length", "num_frames", "fps") if k in data}
        sizes = data.get("image_sizes") or ()
        if not isinstance(sizes, (list, tuple)) or not all(
                isinstance(s, (list, tuple)) and len(s) == 2 for s in sizes):
            raise UsageError("A plan's image_sizes must be a list of [width, height] pairs.")
        fields["image_sizes"] = tuple(InputImage(w, h).size for w, h in sizes)
        last = data.get("last_image_size")
        if last is not None:
            if not isinstance(last, (list, tuple)) or len(last) != 2:
                raise UsageError("A plan's last_image_size must be a [width, height] pair.")
            fields["last_image_size"] = InputImage(*last).size
        frames = data.get("image_frames") or ()
        if not isinstance(frames, (list, tuple)):
            raise UsageError("A plan's image_frames must be a list of frame indices (or nulls).")
        fields["image_frames"] = tuple(frames)
        return cls(**fields)


def read_through(holder: str, name: str) -> property:
    """A read-only attribute that reads `holder`'s `name`: for records held whole where they are kept (a job's
    Generation, a result's Job, a session's SettledRun), so that no holder copies them."""
    return property(lambda self: getattr(getattr(self, holder), name), doc=f"The {holder}'s `{name}`.")


@dataclass(frozen=True)
class Generation:
    """One generation request: everything that changes pixels or memory, but the prompt and the seed.

    None: not given; `Family.settle` fills the pipeline's (or the demo's, or the plan file's) default,
    and `Family.validate` applies the pipeline's rules, the same for `dmap plan`, `dmap run`, the
    Python API, queue items and plan files. `settings` are the family's own (`Family.settings`: Qwen-Image's
    true_cfg_scale, Wan 2.2's guidance_scale_2), as sorted (name, value) pairs so the request stays hashable.
    """

    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    max_sequence_length: int | None = None
    num_images: int | None = None
    batch_size: int = 1
    settings: tuple[tuple[str, object], ...] = ()
    images: tuple[InputImage, ...] = ()  # input images (editing, references, image-to-video), in order
    last_image: InputImage | None = None  # the video's last frame (Wan 2.2 first-last-frame image-to-video)
    loras: tuple[LoraAdapter, ...] = ()  # LoRA adapters (--lora), in order: the pixels and the denoiser's bytes change
    cache: StepCache | None = None  # --cache: a diffusers step cache on the denoiser (None: every step computed)

    def __post_init__(self) -> None:
        """The counts' bounds (LIMITS) before anything else looks at them."""
        check_counts(steps=self.steps, num_images=self.num_images, height=self.height, width=self.width,
                     max_sequence_length=self.max_sequence_length, num_frames=self.num_frames, fps=self.fps)
        if self.guidance_scale is not None:
            check_scale(self.guidance_scale)
        if self.negative_prompt is not None:
            check_text(self.negative_prompt, "--negative-prompt")

    def setting(self, name: str, default=None):
        return dict(self.settings).get(name, default)

    def given_over(self, base: "Generation") -> "Generation":
        """`base` with every setting this one gives in its place: a queue line's or a served request's own settings
        (`QueueItem.given`) over the run's generation. A field left at its default (None, (), a batch of 1) is not
        given and keeps `base`'s; the family's settings merge, these over `base`'s."""
        blank = Generation()
        given = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name != "settings" and getattr(self, f.name) != getattr(blank, f.name)}
        return replace(base, **given).with_settings(dict(self.settings))

    def with_settings(self, values: dict) -> "Generation":
        """These settings over the ones already given (None leaves a setting as it is)."""
        merged = {**dict(self.settings), **{k: v for k, v in values.items() if v is not None}}
        return replace(self, settings=tuple(sorted(merged.items())))

    @property
    def weights_only(self) -> bool:
        return self.height == 0 or self.width == 0

    @property
    def video_fps(self) -> int | None:
        """The frame rate a video is written at; None for images (a frame rate without frames means nothing)."""
        return self.fps if self.num_frames else None

    def inputs(self) -> InputSpec:
        """What the tracer and the planner read of it (the pixel bound is checked there)."""
        return InputSpec(self.height, self.width, self.batch_size, self.num_images or 1, self.guidance_scale,
                         self.max_sequence_length, self.num_frames, self.fps,
                         tuple(image.size for image in self.images),
                         self.last_image.size if self.last_image is not None else None,
                         tuple(image.frame for image in self.images) if any(
                             image.frame is not None for image in self.images) else ())


@dataclass(frozen=True)
class PlacementSpec:
    """Where a generation runs and how its weights are held: the devices and their budgets, the planner's
    strategy and mode, per-device overhead, the compute dtype and the weight storage. One type for
    `dmap plan` (`PlanOptions.placement`), `dmap run` (`RunRequest.placement`), the Python API and a plan
    file (`Plan.placement`: what it was made with). Strings as the command line takes them; the planner
    parses and checks them (`dm_cli.planning.make.make_plan`), one sentence each.
    """

    max_memory: str | None = None  # device spec "0=16GB,1=16GB,cpu=64GB"; None: this machine's devices
    strategy: str = "auto"  # auto | balanced | balanced_low_0 | sequential
    mode: str = "auto"  # auto | resident | staged
    overhead: str | None = None  # per-device overhead "0=600MB,cpu=0"; None: 600 MB per GPU
    dtype: str | None = None  # compute dtype (a torch name or alias); None: as stored (bf16 for config-only sources)
    weights: str | None = None  # weight storage "fp8", "int8", "transformer=fp8,text_encoder=int8"; None: the dtype

