"""The options of a plan and a run, each declared once: flag, type, default, help, parser, and who takes it.

One row per option of `dmap plan`, `dmap run` and `dmap serve`. The CLI makes those commands' Typer parameters from
these rows (`dm_cli.cli._cli_utils.table_options`), the Python API refuses a keyword its function does not take with
the row's reason (`refuse_untaken`), and a queue item's JSON keys are the rows a queue takes (`queue_keys`). Every
row is taken by all of TAKERS unless its `without` says why not; `tests/cli/test_options_table.py` walks the table over
the Typer commands, the API's signatures and the queue's keys. Plain data: no Typer here (the CLI wraps it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dm_cli.errors import UsageError
from dm_cli.planning.modes import CompileMode, Mode, Parallel, Strategy, Word

# who takes the options: the three commands, the two API functions (`dm_cli.plan`, `dm_cli.load`) and a queue item
# (a `--prompts` JSONL line's keys, dm_cli.run.sessions.queue.queue_item)
TAKERS = ("plan", "run", "serve", "api.plan", "api.load", "queue")
API_NAMES = {"api.plan": "dm_cli.plan", "api.load": "dm_cli.load"}
REQUIRED = object()  # the default of an argument that must be given (dmap plan's SOURCE)


@dataclass(frozen=True)
class Option:
    """One option: its flags (an argument: its metavar), its type and default, its help; `words`: it takes one of
    these words (parsed while the command line is read); `api` and `key`: its name as an API keyword and as a queue
    item's JSON key, where they differ from `name`; `without`: taker -> why it does not take it; `variants`:
    command -> the fields that read otherwise there (a plan's --height makes weights-only plans, ...)."""

    name: str
    flags: tuple[str, ...]
    type: object
    help: str
    default: object = None
    metavar: str | None = None
    min: int | None = None
    words: type[Word] | None = None
    envvar: str | None = None
    argument: bool = False
    api: str | None = None
    key: str | None = None
    without: dict = field(default_factory=dict)
    variants: dict = field(default_factory=dict)

    @property
    def api_name(self) -> str:
        return self.api or self.name

    @property
    def key_name(self) -> str:
        return self.key or self.name

    def takes(self, taker: str) -> bool:
        return taker not in self.without

    def for_command(self, command: str | None) -> "Option":
        """The row as `command` declares it (its variant, if any)."""
        return replace(self, **self.variants[command]) if command in self.variants else self


def _without(reason: str, *takers: str) -> dict:
    """`takers` (by the names in TAKERS) all without the option for one reason."""
    return dict.fromkeys(takers, reason)


SERVER = "a server's own (dm_cli.serve.server.ServeRequest)"
QUEUE_RUN = "every item of a queue runs with the run's (one placement, loaded once)"
ONE_PROMPT = "for one prompt: refused with --prompts"
PRINTING = "how the command prints; the API prints nothing and returns objects"
PLAN_ONLY = "planning only: a run follows its plan (a plan file's, or one made inline for this machine)"
NO_FILE = "writes no file: it answers over HTTP"
API_NO_FILE = "returns objects and writes no file"
REQUEST_IMAGES = "each request brings its input images"
PLAN_NO_PIXELS = "a plan needs no pixels: --image-size and --last-image-size give the sizes alone"
RUN_READS_IMAGES = "a run reads the images themselves: --image and --last-image"
SOURCE_OF_RUN = "a queue has one SOURCE, loaded once for every item"
STRATEGY_IN_DEVICE_MAP = "--device-map takes the strategy (or a plan file)"
CHUNKS = "how a staged queue's prompts wait between stages: a run's own"
PLAN_IS_MADE = "it makes the plan (its strategy is --strategy)"

_SOURCE_HELP = "Pipeline/component folder, .safetensors, index JSON, preset or Hub repo id."
_HEIGHT_HELP = "Height in pixels (default: the pipeline's, e.g. 1024 for FLUX, 480 for Wan)"
_NUM_IMAGES_HELP = "Images per prompt (dmap run writes out-0.png, out-1.png, ...; default 1, or the plan file's)."
_PARALLEL_HELP = "How torchrun ranks share each denoising step: none | cfg | context | cfg+context | pipeline | auto"
_DEVICE_MAP_HELP = "auto | balanced | balanced_low_0 | sequential (plan now), or a plan JSON from dmap plan."

_PLAN_PROMPT_HELP = ("The prompt the predicted time is for (Qwen-Image and Z-Image run its own length; default: "
                     "the longest text).")
OPTIONS: tuple[Option, ...] = (
    # ---- SOURCE and what the pipeline is asked for ------------------------------------------------------------
    Option("source", ("SOURCE",), str | None, argument=True, metavar="SOURCE",
           help="Pipeline folder, preset or Hub repo id (default: the bundled random-weight FLUX demo).",
           without={"queue": SOURCE_OF_RUN},
           variants={"plan": {"type": str, "default": REQUIRED, "help": _SOURCE_HELP}}),
    Option("prompt", ("--prompt", "-p"), str | None, "What to draw.",
           without={"serve": "each request brings its prompt", "api.load": "each generate() call brings its prompts"},
           variants={taker: {"help": _PLAN_PROMPT_HELP} for taker in ("plan", "api.plan")}),
    Option("prompts", ("--prompts",), str | None,
           "A queue: a text file (one prompt a line) or JSONL (prompt, negative_prompt, seed, steps, guidance_scale, "
           "output per line); item i gets seed --seed + i.",
           without={"plan": "a plan is for one call; --queue counts prompts for the predicted time",
                    "api.plan": "a plan is for one call; queue= counts prompts for the predicted time",
                    "serve": "its requests are its queue", "api.load": "generate() takes the prompts, a list of them",
                    "queue": "an item is one prompt of the queue"}),
    Option("negative_prompt", ("--negative-prompt",), str | None, "What to avoid (CFG and true-CFG pipelines)."),
    Option("image", ("--image",), list[str] | None, metavar="PATH",
           help="An input image (editing, references, image-to-video); repeat for several, in order. "
                "LTX-2 keyframes: PATH@FRAME[:STRENGTH] conditions that video frame.",
           without={"serve": REQUEST_IMAGES}),
    Option("last_image", ("--last-image",), str | None, metavar="PATH",
           help="The video's last frame (Wan 2.2 image-to-video from a first and a last frame, with --image); for "
                "dmap plan a path or its size WxH.",
           without={"serve": REQUEST_IMAGES}),
    Option("last_image_size", ("--last-image-size",), str | None, metavar="WxH",
           help="The last frame's size only (a plan needs no pixels).",
           without=_without(RUN_READS_IMAGES, "run", "api.load", "queue") | {"serve": REQUEST_IMAGES}),
    Option("image_size", ("--image-size",), list[str] | None, metavar="WxH",
           help="An input image's size only (a plan needs no pixels); repeatable.",
           without=_without(RUN_READS_IMAGES, "run", "api.load", "queue") | {"serve": REQUEST_IMAGES}),
    # ---- devices and planning ---------------------------------------------------------------------------------
    Option("device_map", ("--device-map", "-d"), str, _DEVICE_MAP_HELP, default="auto", api="plan",
           without={"plan": PLAN_IS_MADE, "api.plan": PLAN_IS_MADE, "queue": QUEUE_RUN},
           variants={"api.load": {"default": None}}),  # load(plan=None): plan here, at its strategy= (auto)
    Option("max_memory", ("--max-memory", "-m"), str | None,
           "Devices to plan for, e.g. 0=16GB,1=16GB,cpu=64GB,disk (default: this machine).", without={"queue": QUEUE_RUN}),
    Option("strategy", ("--strategy",), Strategy, "auto | sequential | balanced | balanced_low_0.", default="auto",
           words=Strategy, without={"run": STRATEGY_IN_DEVICE_MAP, "serve": STRATEGY_IN_DEVICE_MAP, "queue": QUEUE_RUN}),
    Option("mode", ("--mode",), Mode, "auto | resident (all loaded at once) | staged (per stage), for the plan made here.",
           default="auto", words=Mode, without={"queue": QUEUE_RUN}),
    Option("overhead", ("--overhead",), str | None,
           "Per-device overhead for the plan made here, e.g. 0=600MB,1=600MB (default 600MB per GPU, 0 for cpu).",
           without={"queue": QUEUE_RUN}),
    Option("steps", ("--steps",), int | None, "Denoising steps (default: the pipeline's).", min=1,
           without={"api.load": "each generate() call gives its steps"},
           variants={"serve": {"help": "Denoising steps of a request that gives none (default: the pipeline's)."}}),
    Option("guidance_scale", ("--guidance-scale",), float | None, "Guidance (CFG) scale (default: the pipeline's)."),
    Option("seed", ("--seed",), int, "Random seed, 0 to 2^64-1: same seed, same image.", default=0,
           without={"plan": "a plan does not depend on the seed", "api.plan": "a plan does not depend on the seed",
                    "serve": "each request brings its seed", "api.load": "each generate() call brings its seed"}),
    Option("height", ("--height",), int | None, f"{_HEIGHT_HELP}.", without={"queue": QUEUE_RUN},
           variants={"plan": {"help": f"{_HEIGHT_HELP}; 0 = weights only (no activations, no GPU overhead unless "
                                      "--overhead)."}}),
    Option("width", ("--width",), int | None, "Width in pixels (default: the pipeline's).", without={"queue": QUEUE_RUN}),
    Option("batch_size", ("--batch-size",), int, "Prompts per call.", default=1,
           without=_without("a run makes batch 1 (a plan file's batch size is refused)", "run", "api.load", "queue")
           | {"serve": "--max-batch bounds its batches"}),
    Option("num_images", ("--num-images",), int | None, _NUM_IMAGES_HELP, min=1,
           without={"serve": "each request asks for its n", "api.load": "generate() makes one image per prompt",
                    "queue": "one image per item: repeat a line with another seed"},
           variants={"plan": {"default": 1, "min": None}, "api.plan": {"default": 1, "min": None}}),
    Option("max_sequence_length", ("--max-sequence-length",), int | None,
           "T5/LLM prompt tokens (FLUX, SD3, Wan, Qwen-Image; default: the pipeline's).", without={"queue": QUEUE_RUN}),
    Option("frames", ("--frames",), int | None,
           "Video pipelines: frames to generate, 4k+1 for Wan (default: the pipeline's, 81).", api="num_frames",
           without={"queue": ONE_PROMPT}),
    Option("fps", ("--fps",), int | None,
           "Video pipelines: frames per second of the video (default: the pipeline's, 16 for Wan).",
           without={"queue": ONE_PROMPT}),
    # ---- outputs ----------------------------------------------------------------------------------------------
    Option("output", ("--output", "-o"), str | None,
           "Image to write, in the format its suffix names: .png (default dmap.png), .jpg/.jpeg or .webp (prompt, seed "
           "and plan in its metadata); videos: out.mp4 (the default dmap.mp4), out.webp, out.gif or a folder out/ of "
           "PNG frames, each with a JSON sidecar; with --prompts the folder (default dmap-out).",
           without={"serve": NO_FILE, "api.plan": API_NO_FILE + " (write_plan writes a Plan)",
                    "api.load": API_NO_FILE + " (generate() yields the images)"},
           variants={"plan": {"help": "Write the plan JSON (dmap-plan v1; v2 when a decode is tiled) here."}}),
    Option("save_latents", ("--save-latents",), str | None, "Also write the final latents (safetensors).",
           without={"plan": "a plan has no latents", "api.plan": "a plan has no latents", "serve": NO_FILE,
                    "api.load": API_NO_FILE, "queue": ONE_PROMPT}),
    # ---- dtypes and weight storage ----------------------------------------------------------------------------
    Option("dtype", ("--dtype",), str | None,
           "Compute dtype: bf16 | fp16 | fp32 (default: as stored, bf16 for configs, or a plan file's).",
           without={"queue": QUEUE_RUN}),
    Option("weights", ("--weights", "-w"), str | None,
           "Weights stored as fp8 | int8 | nf4 and computed in --dtype (every component but the VAE), or per component: "
           "transformer=fp8,text_encoder=fp8 (default: as stored, or a plan file's).", without={"queue": QUEUE_RUN}),
    # ---- how the run runs -------------------------------------------------------------------------------------
    Option("simulate", ("--simulate",), bool,
           "Run every planned device on this CPU with the split check (plans for GPUs you lack).", default=False,
           without=_without("a plan is made on the meta device, with the split check", "plan", "api.plan")
           | {"queue": QUEUE_RUN}),
    Option("overwrite", ("--overwrite",), bool,
           "Replace the output if it exists (only ever what dmap writes); for dmap run also --save-latents, and with "
           "--prompts: --no-resume.", default=False,
           without={"serve": NO_FILE, "api.plan": API_NO_FILE, "api.load": API_NO_FILE, "queue": QUEUE_RUN}),
    Option("track_activations", ("--track-activations",), bool,
           "Measure activations op by op on CPU (slower; default: the process's peak RSS).", default=False,
           without=_without("a plan traces activations on the meta device", "plan", "api.plan")
           | {"serve": "it measures no run", "api.load": "only dmap run --prompt's measured run",
              "queue": ONE_PROMPT}),
    Option("resume", ("--resume/--no-resume",), bool,
           "--prompts: skip items whose PNG is complete and made for them (default), or redo all.", default=True,
           without=_without("for dmap run --prompts, whose output folder it resumes", "plan", "serve", "api.plan",
                            "api.load", "queue")),
    Option("chunk_size", ("--chunk-size",), int | None,
           "--prompts, staged: prompts per chunk (default: what --chunk-memory holds).", min=1,
           without=_without(CHUNKS, "plan", "api.plan")
           | {"serve": "--max-batch bounds its batches", "api.load": "a generate() keyword", "queue": QUEUE_RUN}),
    Option("chunk_memory", ("--chunk-memory",), str | None,
           "--prompts, staged: RAM for embeddings and latents waiting between stages (default: 10% of available RAM).",
           without=_without(CHUNKS, "plan", "api.plan")
           | {"serve": "--max-batch bounds its batches", "api.load": "a generate() keyword", "queue": QUEUE_RUN}),
    Option("gpus_per_rank", ("--gpus-per-rank",), int | None,
           "Under torchrun: local rank r uses GPUs r*K .. r*K+K-1 of its node.", min=0,
           without=_without("it plans for --world-size ranks, rank r on GPU r", "plan", "api.plan")
           | {"api.load": "the caller picks its GPUs (CUDA_VISIBLE_DEVICES)", "queue": QUEUE_RUN}),
    Option("parallel", ("--parallel",), Parallel | None,
           f"{_PARALLEL_HELP} (under torchrun; default the plan file's 'parallel', else none).", words=Parallel,
           without={"queue": "the ranks of a queue share its prompts"},
           variants={"plan": {"help": f"{_PARALLEL_HELP} (for --world-size: default none for one rank, auto above)."}}),
    Option("pipeline", ("--pipeline",), str | None,
           "SOURCE is a single file (original-layout .safetensors or .gguf) holding one component: the rest of the "
           "pipeline (plan: a preset or a folder; run: a folder with weights; shard --to-diffusers: a preset or folder "
           "whose first matching component's config the file takes, default the preset dmap recognizes it as).",
           without={"queue": SOURCE_OF_RUN}),
    Option("component_file", ("--component-file",), list[str] | None, metavar="COMPONENT=FILE", api="component_files",
           help="This component from this single file (original-layout .safetensors or .gguf), e.g. "
                "transformer_2=low_noise.gguf for Wan 2.2's second expert; repeatable.",
           without={"queue": SOURCE_OF_RUN}),
    Option("lora", ("--lora",), list[str] | None, metavar="[COMPONENT=]FILE[:SCALE]",
           help="A LoRA adapter (diffusers/peft .safetensors) for the denoiser, at SCALE (default 1.0); Wan 2.2's "
                "second expert: transformer_2=FILE; repeatable."),
    Option("cache", ("--cache",), str | None, metavar="NAME[:KEY=VALUE,...]",
           help="A step cache on the denoiser, diffusers' hooks: fbc (First-Block Cache), taylorseer or magcache, e.g. "
                "fbc:threshold=0.05; the plan counts what it holds per device (run: default the plan file's; none runs "
                "the plan file without its cache)."),
    Option("compile", ("--compile",), CompileMode,
           "torch.compile the denoiser as it loads: none | regional (its repeated blocks, diffusers' "
           "compile_repeated_blocks; the whole model where it declares none) | auto (= regional) | full (the whole "
           "model). What cannot compile runs eager with a notice saying why; dmap plan predicts the step as it "
           "compiles.", default="none", words=CompileMode, without={"queue": QUEUE_RUN}),
    # ---- planning only ----------------------------------------------------------------------------------------
    Option("component", ("--component", "-c"), str | None, "Only this component.",
           without=_without("a run runs the whole pipeline", "run", "serve", "api.load", "queue")),
    Option("no_check", ("--no-check",), bool, "Skip the split check on the meta device.", default=False, api="check",
           without=_without(PLAN_ONLY, "run", "serve", "api.load", "queue")),
    Option("no_cache", ("--no-cache",), bool,
           "Rebuild skeletons (and, for dmap plan, traces) instead of using the cache.", default=False, api="use_cache",
           without=_without(PLAN_ONLY, "run", "serve", "api.load", "queue")),
    Option("world_size", ("--world-size",), int, "torchrun ranks to plan for (rank r on GPU r); 1: one process.",
           default=1, without=_without("the ranks are the launch's (torchrun's WORLD_SIZE)", "run", "serve", "api.load")
           | {"queue": QUEUE_RUN}),
    Option("device_tflops", ("--device-tflops",), float | None,
           "--parallel auto: TFLOP/s one GPU sustains (default: the device profile's).",
           without=_without(PLAN_ONLY, "run", "serve", "api.load", "queue")),
    Option("link_gbps", ("--link-gbps",), float | None,
           "--parallel auto: GB/s between two GPUs (default: the device profile's).",
           without=_without(PLAN_ONLY, "run", "serve", "api.load", "queue")),
    Option("profile", ("--profile",), str | None, metavar="FILE",
           help="Device profile for the predicted step time: a file dmap calibrate wrote, or table:NAME (h100-sxm, "
                "l40s, ...). Default: this machine's calibrated one, else dmap's defaults.",
           without=_without(PLAN_ONLY, "run", "serve", "api.load", "queue")),
    Option("queue", ("--queue",), int, "Prompts the predicted time per queue counts.", default=1, metavar="N",
           without={"run": "--prompts is the queue itself", "serve": "--queue-size bounds its queue",
                    "api.load": "generate() takes the prompts", "queue": "an item is one prompt of the queue"}),
    Option("in_flight", ("--in-flight",), int | None, "--parallel pipeline: queue prompts in flight (default --world-size).",
           metavar="K", without=_without(PLAN_ONLY, "run", "serve", "api.load", "queue")),
    # ---- what is printed --------------------------------------------------------------------------------------
    Option("as_json", ("--json",), bool, "Print JSON instead of tables: stdout carries only the JSON document.",
           default=False, without=_without(PRINTING, "api.plan", "api.load", "queue")
           | {"serve": "it prints a line per event and answers JSON over HTTP"}),
    Option("quiet", ("--quiet", "-q"), bool,
           "No tables nor progress: only warnings, errors and what was written where.", default=False,
           without=_without(PRINTING, "api.plan", "api.load", "queue")),
    Option("binary", ("--binary",), bool, "Print sizes in GiB instead of GB.", default=False,
           without=_without(PRINTING, "api.plan", "api.load", "queue") | {"serve": "it prints no sizes"}),
    # ---- dmap serve's own -------------------------------------------------------------------------------------
    Option("host", ("--host",), str, "Address to listen on (0.0.0.0: every interface).", default="127.0.0.1",
           without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
    Option("port", ("--port",), int, "Port to listen on (0: any free port, printed).", default=8000,
           without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
    Option("api_key", ("--api-key",), str | None, "Require 'Authorization: Bearer KEY' on every route but /health.",
           envvar="DMAP_API_KEY", without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
    Option("queue_size", ("--queue-size",), int,
           "Images that may wait; a request that does not fit is answered 429 (400 when it asks for more images than "
           "the whole queue holds).", default=64,
           without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
    Option("max_batch", ("--max-batch",), int,
           "Images generated together at most, stage-major (and at most what 10% of RAM holds between stages); within "
           "it, the batch size measured fastest (1 to start on a CPU).", default=8,
           without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
    Option("max_body", ("--max-body",), int, "Largest request body in bytes (base64 input images).", default=64 * 2**20,
           without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
    Option("model_name", ("--model-name",), str | None,
           "The model id /v1/models lists and requests may name (default: SOURCE, or demo).",
           without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
    Option("max_connections", ("--max-connections",), int | None,
           "Open connections at most; at the bound the oldest idle one makes room (default: what the file limit, "
           "ulimit -n, leaves room for, at most 4096).",
           without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
    Option("read_timeout", ("--read-timeout",), float,
           "Seconds a client has to send a whole request head, and the longest its body may pause.", default=10.0,
           without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
    Option("body_timeout", ("--body-timeout",), float, "Seconds a request body may take in all.", default=300.0,
           without=_without(SERVER, "plan", "run", "api.plan", "api.load", "queue")),
)

BY_NAME = {option.name: option for option in OPTIONS}


def option(name: str, command: str | None = None) -> Option:
    """The row named `name`, as `command` declares it."""
    return BY_NAME[name].for_command(command)


def queue_keys() -> frozenset[str]:
    """The JSON keys of a queue item (a --prompts JSONL line) that are options: the rows a queue takes."""
    return frozenset(row.key_name for row in OPTIONS if row.takes("queue"))


def refuse_untaken(taker: str, keywords) -> None:
    """An API keyword naming an option this function does not take (or takes by another name), refused in one
    sentence with the table's reason, before anything is resolved; other keywords are the families' settings."""
    function = API_NAMES[taker]
    for key in keywords:
        row = next((row for row in OPTIONS if key in (row.name, row.api_name)), None)
        if row is None:
            continue
        if not row.takes(taker):
            raise UsageError(f"{function} takes no {key}=: {row.without[taker]}.")
        if key != row.api_name:
            raise UsageError(f"{function} takes {row.flags[0]} as {row.api_name}=, not {key}=.")
