"""A request's JSON body to the items the session generates: OpenAI's images fields and dmap's own, every refusal
one sentence (the server answers it with a 400).

OpenAI's keys: `prompt`, `n`, `size` ("WxH" or "auto"), `response_format` (only "b64_json": dmap keeps no files to
link to), `output_format` (png, jpeg, webp; mp4 for videos), `model` (the served one, or absent) and `user`
(ignored: it changes no pixel). OpenAI's keys that would change the pixels in a way dmap cannot honour (`quality`,
`style`, `background`, ...) are refused, each with the sentence why (OPENAI_REFUSED). dmap's own, exactly as a
`--prompts` JSONL line has them: `seed`, `steps`, `guidance_scale`, `negative_prompt` and the family's settings
(`true_cfg_scale`, ...), checked by the same code (`dm_cli.run.sessions.queue.queue_item`); `image` and `last_image` are
base64 (or data: URLs) instead of paths, read as hostile as `--image` files are; `lora` chooses among the adapters
the server loaded (`"NAME[:SCALE]"`, a list of them, or `[]`), as a queue item's does (`ServedRequest.adapters`: the
worker batches by them). Then `Session.job_for` settles and checks the job as it does a queue item's, before the
request takes a place. The sentences of that shared code name `dmap run`'s flags: a client sent
JSON keys, so they are said as keys (FLAG_KEYS, `as_keys`).
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from dataclasses import dataclass, replace

from dm_cli.errors import UsageError
from dm_cli.families import all_settings
from dm_cli.io.images import check_metadata_room
from dm_cli.io.input_images import describe_bytes
from dm_cli.run.entry_checks import check_seed, load_json
from dm_cli.run.sessions.queue import QueueItem, default_output_name, queue_item

MAX_N = 10  # images per request, as OpenAI's images API
MAX_PROMPT_CHARS = 10_000
OPENAI_KEYS = ("prompt", "n", "size", "response_format", "output_format", "model", "user")
# OpenAI's keys that would change the pixels in a way dmap cannot honour: refused, with why (`user` changes none:
# accepted and ignored)
OPENAI_REFUSED = {
    "quality": "dmap makes the plan's pixels at the steps asked for: give 'steps' instead",
    "style": "dmap has no style switch (it is DALL-E 3's): say the style in 'prompt'",
    "background": "dmap makes no transparent backgrounds: say the background in 'prompt'",
    "output_compression": "dmap encodes as `dmap run` does, so that a served image is its file byte for byte",
    "moderation": "dmap runs no moderation model",
    "stream": "dmap answers each request whole, with no partial images",
    "partial_images": "dmap answers each request whole, with no partial images",
}
DMAP_KEYS = ("seed", "steps", "guidance_scale", "negative_prompt", "image", "last_image", "lora")
# `dmap run`'s flags as the JSON keys a request gives instead (the shared checks name flags): one table
FLAG_KEYS = {"--prompt": "prompt", "--negative-prompt": "negative_prompt", "--seed": "seed", "--steps": "steps",
             "--guidance-scale": "guidance_scale", "--image": "image", "--last-image": "last_image", "--lora": "lora",
             "--num-images": "n", "--height": "size", "--width": "size"}
# the largest random seed: a request's n images take seeds seed .. seed + n - 1, and every one stays below 2^53, the
# largest whole number a JSON client in JavaScript (or jq) reads exactly
MAX_RANDOM_SEED = 2**53 - 1 - MAX_N
NOT_QUEUE_KEYS = {*OPENAI_KEYS, "image", "last_image"} - {"prompt"}
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "MP4": "video/mp4"}
WHERE = "The request"
_SIZE = re.compile(r"^([0-9]{1,6})x([0-9]{1,6})$")
_DATA_URL = re.compile(r"^data:[a-z0-9.+/-]{0,64};base64,", re.IGNORECASE)


@dataclass(frozen=True)
class Served:
    """What the server serves, as requests are checked against it."""

    model: str  # the id GET /v1/models lists
    width: int
    height: int
    video: bool  # a video family: POST /v1/videos/generations
    max_input_images: int  # the family's (0: it takes none)
    loras: tuple[tuple[str, float], ...] = ()  # the adapters loaded at start (file name, scale): a request chooses
    max_n: int = MAX_N
    settings: tuple[str, ...] | None = None  # the family's own settings' names (None: every family's)
    negative_prompt: bool = True  # the family takes a negative prompt
    last_image: bool = False  # the family takes a video's last frame

    def keys(self) -> list[str]:
        """The keys a request to this model may give (the unknown-key sentence offers these, and no key the model
        then refuses)."""
        mine = [*OPENAI_KEYS, "seed", "steps", "guidance_scale"]
        mine += ["negative_prompt"] * self.negative_prompt + ["image"] * bool(self.max_input_images)
        mine += ["last_image"] * self.last_image + ["lora"] * bool(self.loras)
        return sorted({*mine, *(all_settings() if self.settings is None else self.settings)})


def as_keys(message: str) -> str:
    """A sentence of the checks `dmap run` shares, said to a client that sent JSON: each flag as its key."""
    flags = {**FLAG_KEYS, **{setting.flag: name for name, setting in all_settings().items()}}
    return re.sub(r"(?<![\w-])--[a-z][a-z0-9-]*", lambda flag: f"'{flags[flag.group()]}'" if flag.group() in flags
                  else flag.group(), message)


@dataclass(frozen=True)
class ServedRequest:
    items: tuple[QueueItem, ...]  # one per image, seeds seed, seed + 1, ...
    output_format: str  # PNG, JPEG, WEBP, or MP4 for videos
    adapters: tuple[str, ...] = ()  # the LoRAs its images run with (LoraAdapter.key: component, digest, scale), in order

    @property
    def mime(self) -> str:
        return MIME[self.output_format]


def shorten(text, keep: int = 80) -> str:
    """A value echoed back in a message: its repr, cut to `keep` characters (a hostile key may be megabytes)."""
    shown = repr(text)
    return shown if len(shown) <= keep else shown[:keep] + "…"


def parse_body(body: bytes) -> dict:
    """The JSON object of a request's body."""
    try:
        data = load_json(body.decode("utf-8"), f"{WHERE} body")
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise UsageError(f"{WHERE} body is not JSON: send a JSON object such as {{\"prompt\": \"a red fox\"}}.") from None
    if not isinstance(data, dict):
        raise UsageError(f"{WHERE} body is not a JSON object: send {{\"prompt\": \"...\"}}.")
    return data


def parse_request(data: dict, served: Served, session) -> ServedRequest:
    """The items of one request, settled and checked by `session` (Session.job_for) as a queue's items are."""
    refused = next((key for key in OPENAI_REFUSED if key in data), None)
    if refused is not None:
        raise UsageError(f"{WHERE} gives OpenAI's '{refused}', which dmap serve does not take: "
                         f"{OPENAI_REFUSED[refused]}.")
    # another family's setting is known (the family says whose it is); only this model's keys are offered
    known = set(OPENAI_KEYS) | set(DMAP_KEYS) | set(all_settings())
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        shown = ", ".join(shorten(key, 40) for key in unknown[:5]) + (", …" if len(unknown) > 5 else "")
        raise UsageError(f"{WHERE} has unknown key(s) {shown}: this model takes {', '.join(served.keys())}.")
    _check_model(data.get("model"), served)
    output_format = _output_format(data, served)
    n = data.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= served.max_n:
        raise UsageError(f"{WHERE}: 'n' must be an integer from 1 to {served.max_n} (got {shorten(n, 20)}).")
    _check_size(data.get("size"), served)
    for key in ("prompt", "negative_prompt"):
        value = data.get(key)
        if isinstance(value, str) and len(value) > MAX_PROMPT_CHARS:
            raise UsageError(f"{WHERE}: '{key}' has {len(value):,} characters, more than the {MAX_PROMPT_CHARS:,} "
                             "a prompt may have here.")
    seed = data.get("seed")
    if seed is None:  # a client that gives none gets a new image each time, and hears its seed
        seed = secrets.randbelow(MAX_RANDOM_SEED + 1)
    own = {key: data[key] for key in data if key not in NOT_QUEUE_KEYS}  # what a --prompts JSONL line has
    try:
        first = queue_item({**own, "seed": seed}, 0, 0, WHERE)
    except UsageError as error:
        raise UsageError(as_keys(str(error))) from None
    images = _images(data.get("image"), served)
    last = _last_image(data.get("last_image"), served)
    if output_format == "JPEG":
        check_metadata_room("served.jpg", first.prompt, first.negative_prompt, f"{WHERE}'s 'output_format' jpeg")
    given = replace(first.given, images=images, last_image=last)  # the images as the server read them
    items = tuple(replace(first, index=i, seed=check_seed(first.seed + i, f"{WHERE}: the seed of image {i + 1}"),
                          output=default_output_name(i), given=given) for i in range(n))
    try:
        job = session.job_for(items[0])  # the rules a queue item meets: settled and checked as Family.validate says
    except UsageError as error:
        raise UsageError(as_keys(re.sub(r"^Item 0(:?) ", rf"{WHERE}\1 ", str(error)))) from None
    return ServedRequest(items, output_format, tuple(lora.key() for lora in job.loras))


def _check_model(model, served: Served) -> None:
    if model is not None and model != served.model:
        raise UsageError(f"{WHERE} asks for model {shorten(model, 60)}; this server serves {served.model!r} "
                         "(GET /v1/models): give that, or leave 'model' out.")


def _output_format(data: dict, served: Served) -> str:
    response_format = data.get("response_format", "b64_json")
    if response_format != "b64_json":
        raise UsageError(f"{WHERE}: 'response_format' must be \"b64_json\" (got {shorten(response_format, 20)}): dmap "
                         "serve returns the image in the response and keeps no file to link to.")
    wanted = data.get("output_format")
    if served.video:
        if wanted not in (None, "mp4"):
            raise UsageError(f"{WHERE}: 'output_format' must be \"mp4\" for a video (got {shorten(wanted, 20)}).")
        return "MP4"
    if wanted is None:
        return "PNG"
    if not isinstance(wanted, str) or wanted.lower() not in IMAGE_FORMATS:
        raise UsageError(f"{WHERE}: 'output_format' must be png, jpeg or webp (got {shorten(wanted, 20)}).")
    return IMAGE_FORMATS[wanted.lower()]


def _check_size(size, served: Served) -> None:
    """The size the plan was made for (or "auto"): a larger one is over the plan's memory bound, a smaller one
    would be another plan's run (the metadata and the pixels of `dmap run` at that size come from its own plan)."""
    if size is None or size == "auto":
        return
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise UsageError(f"{WHERE}: 'size' must be WIDTHxHEIGHT such as \"{served.width}x{served.height}\", or "
                         f"\"auto\" (got {shorten(size, 30)}).")
    width, height = int(match.group(1)), int(match.group(2))
    if (width, height) == (served.width, served.height):
        return
    if width > served.width or height > served.height:
        raise UsageError(f"{WHERE}: 'size' {width}x{height} is over what this server's plan holds "
                         f"({served.width}x{served.height}): ask for {served.width}x{served.height}, or start "
                         "dmap serve with a plan for the larger size.")
    raise UsageError(f"{WHERE}: 'size' {width}x{height} is not this server's size: it makes "
                     f"{served.width}x{served.height} (the size its plan was made for); ask for that or \"auto\".")


def _decoded(text, where: str):
    """An input image from base64 (or a data: URL), checked as `--image` files are (dm_cli.io.input_images) and kept
    encoded until its batch runs: a waiting request holds its bytes, not its decoded pixels."""
    if not isinstance(text, str) or not text:
        raise UsageError(f"{where} must be a base64 string (or a data: URL) of an image file.")
    text = _DATA_URL.sub("", text[:100], count=1) + text[100:]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise UsageError(f"{where} is not base64: send the image file's bytes base64-encoded.") from None
    return describe_bytes(data, "(base64)", where)


def _images(value, served: Served) -> tuple:
    if value is None:
        return ()
    if not served.max_input_images:
        raise UsageError(f"{WHERE} gives 'image' but this pipeline takes no input image.")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise UsageError(f"{WHERE}: 'image' must be a base64 image or a list of them.")
    if len(texts) > served.max_input_images:
        raise UsageError(f"{WHERE} gives {len(texts)} images; this pipeline takes at most {served.max_input_images}.")
    return tuple(_decoded(text, f"{WHERE}'s 'image' {n + 1}") for n, text in enumerate(texts))


def _last_image(value, served: Served):
    if value is None:
        return None
    if not served.video:
        raise UsageError(f"{WHERE} gives 'last_image', which only a video's last frame takes.")
    return _decoded(value, f"{WHERE}'s 'last_image'")
