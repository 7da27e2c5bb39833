"""Everything a run writes, by kind: images (PNG, JPEG, WebP), videos (MP4, animated WebP, GIF, a folder of
PNG frames, each with a JSON sidecar) and latents (safetensors), each with the run's metadata.

One `OutputKind` per kind says its suffixes, how it is written, how its metadata is read back and how a
written one is decoded whole; `is_complete` (a queue's resume) works the same for every kind. The
encodings are the parts: dm_cli.io.images (names, formats, Pillow metadata) and dm_cli.io.video (video
names, the sidecar, ffmpeg, frame folders). Every file is written under a temporary name beside the
result and renamed when complete (dm_cli.io.atomic).
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from dm_cli.errors import UsageError
from dm_cli.io.atomic import atomic_write, atomic_write_bytes
from dm_cli.io.checkpoint import read_safetensors_header
from dm_cli.io.images import (
    IMAGE_FORMATS,
    image_format,
    image_paths,
    image_save_options,
    metadata_json,
    read_image_metadata,
)
from dm_cli.io.video import (
    FOLDER_SIDECAR,
    FRAME_FORMAT,
    audio_of,
    duration_ms,
    frame_files,
    names_folder,
    probe_mp4,
    read_mp4_metadata,
    sidecar_path,
    video_kind,
    write_frames_folder,
    write_mp4,
    write_wav,
)

LATENTS_SUFFIX = ".safetensors"
# What a finished output must say in its metadata to count as made for the expected job (see is_complete);
# not the plan digest or dmap version: another plan or release makes the same pixels.
MATCHED_METADATA = ("prompt", "negative_prompt", "seed", "steps", "guidance_scale", "height", "width", "source",
                    "tiled_decode",  # a tiled decode changes pixels at the tile seams
                    "input_images",  # editing, references, image-to-video: each input's size and digest
                    "component_files",  # components from single files (SOURCE's, --component-file's): name and sha256
                    "lora",  # LoRA adapters: each one's component, sha256 and scale
                    "lora_fused",  # the components whose LoRAs were fused into the weights
                    "step_cache",  # --cache: the step cache and its settings (changes pixels)
                    "num_frames", "fps")  # videos (images have neither)


class Found(NamedTuple):
    """What decoding a written output whole found: its format, metadata, (width, height) and frame count
    (None where the kind has no such thing)."""

    format: str
    metadata: dict
    size: tuple[int, int] | None = None
    frames: int | None = None


@dataclass(frozen=True)
class OutputKind:
    """One kind of output. `write(data, path, metadata, fps, overwrite)` writes one image, video or latents
    tensor and returns the paths written; `read_metadata(path)` reads the metadata back; `probe(path)`
    decodes it whole (any exception: damaged) and says what it holds."""

    name: str
    suffixes: tuple[str, ...]  # "" is a folder (frames) or no suffix (an image in the default format)
    format: str  # what `probe` finds in a file of this kind
    video: bool  # written by video pipelines
    write: Callable[..., list[str]]
    read_metadata: Callable[[Path], dict]
    probe: Callable[[Path], Found]
    folder: bool = False
    sidecar: bool = False  # a JSON copy of the metadata beside it (video.sidecar_path)

    def exists(self, path: Path) -> bool:
        return path.is_dir() if self.folder else path.is_file()

    def is_complete(self, path: Path, expected: dict[str, str], matched=MATCHED_METADATA) -> tuple[bool, str]:
        """(done, why): see the module's `is_complete`."""
        return _complete(self, path, expected, matched)


# --- writers, one per kind ----------------------------------------------------------------------


def _check_folder(path: Path, shown) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"Cannot write {shown}: folder {parent} does not exist.")


def encode_image(image, fmt: str, metadata: dict[str, str]) -> bytes:
    """The bytes of one image in `fmt` with the run's metadata (`image_save_options`): encoded in memory first, so
    that a write knows how much room it needs before it takes any."""
    if fmt == "JPEG" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **image_save_options(fmt, metadata))
    return buffer.getvalue()


def _image_writer(fmt: str) -> Callable[..., list[str]]:
    def write(image, path: str, metadata: dict[str, str], fps=None, overwrite=False) -> list[str]:
        _check_folder(Path(path), path)
        atomic_write_bytes(path, encode_image(image, fmt, metadata))
        return _written([path])

    return write


def _video_writer(kind: str) -> Callable[..., list[str]]:
    def write(frames, output: str, metadata: dict[str, str], fps: int, overwrite: bool = False) -> list[str]:
        path = Path(output.rstrip("/" + os.sep)) if kind == "frames" else Path(output)
        _check_folder(path, output)
        if fps < 1:
            raise UsageError(f"--fps must be at least 1 (got {fps}).")
        import numpy as np  # lazy: numpy (heavy, off start-up)
        from PIL import Image  # lazy: PIL (heavy, off start-up)

        audio = audio_of(frames)  # LTX-2: the video's audio track (in the MP4, else a WAV beside the frames)
        if audio is not None:
            metadata = {**metadata, "audio_sample_rate": str(audio[1]), "audio_channels": str(audio[0].shape[0])}
        images = [Image.fromarray(np.asarray(frame)) for frame in frames]
        text = metadata_json(metadata)
        if kind == "frames":
            write_frames_folder(images, path, text, image_save_options(FRAME_FORMAT, metadata), overwrite, audio)
            return _written([str(path), str(path / FOLDER_SIDECAR)])
        if kind == "mp4":
            atomic_write(path, lambda tmp: write_mp4(images, tmp, fps, text, audio))
        else:
            fmt = kind.upper()
            options = {**image_save_options(fmt, metadata), "save_all": True, "append_images": images[1:],
                       "duration": duration_ms(fps), "loop": 0}
            atomic_write(path, lambda tmp: images[0].save(tmp, format=fmt, **options))
            if audio is not None:  # WebP and GIF hold no audio: the track goes beside them
                atomic_write(Path(output + ".wav"), lambda tmp: write_wav(tmp, *audio))
        _written([str(path)] + ([output + ".wav"] if audio is not None and kind != "mp4" else []))
        sidecar = sidecar_path(output)
        atomic_write_bytes(sidecar, (text + "\n").encode("utf-8"))
        return [str(path), *_written([str(sidecar)])]

    return write


def _write_latents(latents, output: str, metadata: dict[str, str], fps=None, overwrite=False) -> list[str]:
    from safetensors.torch import save  # lazy: safetensors (heavy, off start-up)

    path = Path(output)
    _check_folder(path, path)
    atomic_write_bytes(path, save({"latents": latents.contiguous()}, metadata=metadata))  # save_file's bytes
    return _written([str(path)])


# --- readers: the metadata, and the whole output decoded -----------------------------------------


def _pillow_metadata(path: Path) -> dict:
    from PIL import Image  # lazy: PIL (heavy, off start-up)

    with Image.open(path) as image:
        return read_image_metadata(image)


def _frames_metadata(path: Path) -> dict:
    return _pillow_metadata(frame_files(Path(path))[0])


def _latents_metadata(path: Path) -> dict:
    return read_safetensors_header(path, validate=False).metadata


def _probe_pillow(path: Path) -> Found:
    """Every frame decoded (one for a still image): a truncated or corrupt file fails here."""
    from PIL import Image  # lazy: PIL (heavy, off start-up)

    with Image.open(path) as image:
        frames = getattr(image, "n_frames", 1)
        for index in range(frames):
            image.seek(index)
            image.load()
        image.seek(0)
        return Found(image.format, read_image_metadata(image), image.size, frames)


def _probe_image(path: Path) -> Found:
    return _probe_pillow(path)._replace(frames=None)  # a still image's frame count is not compared


def _probe_gif(path: Path) -> Found:
    return _probe_pillow(path)._replace(frames=None)  # Pillow merges identical frames: the count may be fewer


def _probe_frames(path: Path) -> Found:
    files = frame_files(path)
    found = [_probe_image(file) for file in files]
    if not found or len({(f.format, f.size) for f in found}) != 1:
        raise ValueError(f"{path}: no frames, or frames of several formats or sizes")
    return Found(found[0].format, found[0].metadata, found[0].size, len(found))


def _probe_mp4(path: Path) -> Found:
    frames, size = probe_mp4(path)
    return Found("MP4", read_mp4_metadata(path), size, frames)


def _probe_latents(path: Path) -> Found:
    header = read_safetensors_header(path)  # the layout is checked against the file's size: truncation fails
    if "latents" not in header.tensors:
        raise ValueError(f"{path}: no latents tensor")
    return Found("SAFETENSORS", header.metadata)


# --- the kinds ----------------------------------------------------------------------------------


def _image_kind(fmt: str) -> OutputKind:
    suffixes = tuple(suffix for suffix, name in IMAGE_FORMATS.items() if name == fmt)
    return OutputKind(fmt.lower(), suffixes, fmt, False, _image_writer(fmt), _pillow_metadata, _probe_image)


IMAGE_KINDS = {fmt: _image_kind(fmt) for fmt in dict.fromkeys(IMAGE_FORMATS.values())}  # by image_format
VIDEO_KINDS = {  # by video_kind
    "mp4": OutputKind("mp4", (".mp4",), "MP4", True, _video_writer("mp4"), read_mp4_metadata, _probe_mp4, sidecar=True),
    "webp": OutputKind("animated webp", (".webp",), "WEBP", True, _video_writer("webp"), _pillow_metadata,
                       _probe_pillow, sidecar=True),
    "gif": OutputKind("gif", (".gif",), "GIF", True, _video_writer("gif"), _pillow_metadata, _probe_gif, sidecar=True),
    "frames": OutputKind("frames", ("",), FRAME_FORMAT, True, _video_writer("frames"), _frames_metadata, _probe_frames,
                         folder=True, sidecar=True),
}
LATENTS = OutputKind("latents", (LATENTS_SUFFIX,), "SAFETENSORS", False, _write_latents, _latents_metadata,
                     _probe_latents)


def output_kind(output: str | os.PathLike, video: bool = False) -> OutputKind:
    """The kind an output's name says: an image's suffix (image_format), or a video's (video_kind) for video
    pipelines; anything else is the UsageError those give, naming the accepted forms."""
    return VIDEO_KINDS[video_kind(str(output))] if video else IMAGE_KINDS[image_format(output)]


# --- writing ------------------------------------------------------------------------------------

# the outputs written so far by each `written_together` block open in this context (innermost last)
_TOGETHER: contextvars.ContextVar[tuple[list[str], ...]] = contextvars.ContextVar("dmap_written_together", default=())


def _written(paths: list[str]) -> list[str]:
    """Record complete outputs in every open `written_together` block; returns them."""
    for group in _TOGETHER.get():
        group.extend(paths)
    return paths


@contextlib.contextmanager
def written_together():
    """The outputs of one command are all written or none is: when the block fails (a full disk, Ctrl-C), the
    outputs it had completed are removed again, so that the same command runs again as it was given (an
    existing output would stop it without --overwrite). Nothing half-written exists anyway (atomic writes)."""
    group: list[str] = []
    token = _TOGETHER.set((*_TOGETHER.get(), group))
    try:
        yield group
    except BaseException:
        for path in reversed(group):
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
        raise
    finally:
        _TOGETHER.reset(token)


def save_images(images: list, output: str, metadata: dict[str, str]) -> list[str]:
    """Each image in the format its suffix names, with the run's metadata (`image_save_options`): `output`
    for one image, else out-0.png, out-1.png, ... (`image_paths`); all of them or none (`written_together`)."""
    kind = output_kind(output)
    written = []
    with written_together():
        for image, path in zip(images, image_paths(output, len(images))):
            written += kind.write(image, str(path), metadata)
    return written


def save_video(frames, output: str, fps: int, metadata: dict[str, str], overwrite: bool = False) -> list[str]:
    """Write uint8 frames (F, H, W, 3) to `output`; returns the written paths (the video, then the sidecar).

    A frames folder that exists and is not empty is replaced only with `overwrite` (after the new one is complete).
    """
    with written_together():  # the video and its sidecar (and a WebP's or GIF's audio track) or none of them
        return output_kind(output, video=True).write(frames, output, metadata, fps, overwrite)


def save_videos(videos: list, output: str, fps: int, metadata: dict[str, str], overwrite: bool = False) -> list[str]:
    """Each video (uint8 frames) to `output` (out-0.mp4, out-1.mp4, ... when several), with its JSON sidecar."""
    if len(videos) == 1:
        targets = [output]
    elif names_folder(output):  # folders out-0/, out-1/, ...: a dot in the name is not a suffix
        targets = [str(p) + os.sep for p in image_paths(output.rstrip("/" + os.sep), len(videos), "", folder=True)]
    else:
        targets = [str(p) for p in image_paths(output, len(videos), "")]
    written = []
    with written_together():
        for frames, target in zip(videos, targets):
            written += save_video(frames, target, fps, metadata, overwrite)
    return written


def save_latents(latents, output: str, metadata: dict[str, str]) -> str:
    """The final latents as one safetensors tensor, "latents", with the run's metadata."""
    return LATENTS.write(latents, output, metadata)[0]


# --- reading and resume -------------------------------------------------------------------------


def read_metadata(path: str | os.PathLike) -> dict:
    """The metadata any output dmap wrote carries in the file itself ({} when there is none): a folder of frames,
    an MP4, latents, or an image or animation Pillow reads (PNG, JPEG, WebP, GIF)."""
    path = Path(path)
    if path.is_dir():
        return VIDEO_KINDS["frames"].read_metadata(path)
    if path.suffix.lower() == LATENTS_SUFFIX:
        return LATENTS.read_metadata(path)
    if path.suffix.lower() == ".mp4":
        return VIDEO_KINDS["mp4"].read_metadata(path)
    return _pillow_metadata(path)


def is_complete(path: str | os.PathLike, expected: dict[str, str], matched=MATCHED_METADATA) -> tuple[bool, str]:
    """(done, why): the output exists, decodes whole, and its metadata says it was made for `expected`.

    `expected` is the metadata the runner writes for the job (`dm_cli.run.sessions.outputs.job_metadata`): its
    `num_frames` says a video was expected (a `.webp` is then animated), a `.safetensors` name latents.
    The keys in `matched` must agree, the output must have the expected size and frame count, and a
    video its sidecar. A name no kind of the job takes is "made in another format".
    """
    path = Path(path)
    try:
        kind = LATENTS if path.suffix.lower() == LATENTS_SUFFIX else output_kind(path, video="num_frames" in expected)
    except UsageError:
        kind = None
    return _complete(kind, path, expected, matched)


def _complete(kind: OutputKind | None, path: Path, expected: dict[str, str], matched) -> tuple[bool, str]:
    if not (kind.exists(path) if kind else path.is_file()):
        return False, "missing"
    try:
        found = (kind.probe if kind else _probe_image)(path)
    except Exception:  # noqa: BLE001 - any unreadable output is simply not a finished one
        return False, "unreadable"
    if kind is None or found.format != kind.format:  # the format the name says (an older dmap wrote PNG bytes
        return False, "made in another format"  # under any name)
    for key in matched:
        if found.metadata.get(key) != expected.get(key):
            return False, f"made for another {key.replace('_', ' ')}"
    if found.size is not None and found.size != (int(expected["width"]), int(expected["height"])):
        return False, "made for another size"
    if found.frames is not None and found.frames != int(expected["num_frames"]):
        return False, "made for another frame count"
    if kind.sidecar and _sidecar(path) != found.metadata:
        return False, "no sidecar"
    return True, "complete"


def _sidecar(path: Path) -> dict | None:
    try:
        return json.loads(sidecar_path(str(path)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
