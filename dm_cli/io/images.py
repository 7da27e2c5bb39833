"""Single-image outputs, one part of dm_cli.io.outputs: the format a name's suffix says, names the file
system takes, the files of many images (`out-0.png`, ...) made on demand, so that a huge count costs
nothing until it is written, and how the run's metadata is put into (and read from) a Pillow image.

Plain functions, no torch; Pillow only when an image is encoded or read. The writers are dm_cli.io.outputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from dm_cli.errors import UsageError
from dm_cli.io.strict_json import json_text
from dm_cli.io.video import VIDEO_SUFFIXES, names_folder

# The formats a single image is written in, by the output's suffix; the first is the default (no suffix).
IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
DEFAULT_IMAGE_SUFFIX = next(iter(IMAGE_FORMATS))
DEFAULT_IMAGE_FORMAT = IMAGE_FORMATS[DEFAULT_IMAGE_SUFFIX]
IMAGE_SUFFIXES_TEXT = ".png, .jpg, .jpeg or .webp"
EXIF_IMAGE_DESCRIPTION = 0x010E  # where a WebP (still or animated) holds the metadata, as JSON
# atomic_write's temporary file beside an output is named ".NAME.<8 random characters>.tmp" (14 bytes
# more than NAME): a name is kept this much under the file system's limit so its temporary fits too.
TEMP_NAME_RESERVE = 32
# A JPEG comment segment holds at most 65533 bytes; the metadata other than the prompts (numbers, the
# source, which is a path of at most PATH_MAX bytes, the plan digest) fits in this reserve.
JPEG_COMMENT_MAX = 65533
METADATA_RESERVE = 8192


def image_format(output: str | os.PathLike, where: str = "--output", videos: bool = False) -> str:
    """The format an image output's suffix names: PNG, JPEG or WEBP (no suffix: the default, PNG, the name kept
    as given).

    Anything else is a UsageError naming the supported suffixes. `videos=True` (before the pipeline is known:
    `dmap run` checks its options first) also lets the video suffixes, and a folder (`names_folder`: a trailing
    slash, or one that exists), through, as "VIDEO"."""
    if names_folder(output):
        if videos:
            return "VIDEO"
        raise UsageError(f"{where} {_short(str(output))} names a folder: image pipelines write a file, such as "
                         f"{_short(str(Path(output) / 'image.png'))}.")
    suffix = Path(output).suffix.lower()
    if not suffix:
        return DEFAULT_IMAGE_FORMAT
    if suffix in IMAGE_FORMATS:
        return IMAGE_FORMATS[suffix]
    if videos and suffix in VIDEO_SUFFIXES:
        return "VIDEO"
    also = " (video pipelines: .mp4, .webp, .gif or a folder out/)" if videos else ""
    raise UsageError(f"{where} {_short(str(output))}: dmap writes images as {IMAGE_SUFFIXES_TEXT}{also}, "
                     f"not '{_short(suffix)}'.")


def check_file_name(path: Path, where: str, limits: tuple[int, int] | None = None) -> None:
    """A file dmap will create at `path` must have a name (and path) the file system takes, with room for
    its temporary name beside it: UTF-8, no NUL or control characters, within NAME_MAX and PATH_MAX bytes."""
    name = path.name
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{where} {_short(name)} is not UTF-8 text (it has a lone surrogate): give a plain name.") from None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise UsageError(f"{where} {_short(name)} has a NUL or control character: give a plain name.")
    name_max, path_max = limits or name_limits(path.parent)
    if len(raw) + TEMP_NAME_RESERVE > name_max:
        raise UsageError(f"{where} {_short(name)} is a file name of {len(raw)} bytes (UTF-8): at most "
                         f"{name_max - TEMP_NAME_RESERVE} fit (the file system's {name_max}, less room for the "
                         "temporary file): give a shorter name.")
    full = len(os.fsencode(str(path))) + TEMP_NAME_RESERVE
    if full > path_max:
        raise UsageError(f"{where} {_short(str(path))} is a path of {full - TEMP_NAME_RESERVE} bytes: at most "
                         f"{path_max - TEMP_NAME_RESERVE} fit (the system's {path_max}, less room for the temporary "
                         "file): give a shorter path.")


def name_limits(folder: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system a folder (or its nearest existing parent) is on (255, 4096 if unknown)."""
    for _ in range(64):
        if os.path.isdir(folder) or folder == folder.parent:
            break
        folder = folder.parent
    limits = []
    for key, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
        try:
            value = os.pathconf(folder if str(folder) else ".", key)
        except (OSError, ValueError):
            value = -1
        limits.append(value if value and value > 0 else default)
    return limits[0], limits[1]


def _short(text: str, keep: int = 60) -> str:
    """A name for a message: at most `keep` characters, a lone surrogate shown as its escape (never unprintable)."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= keep else text[:keep] + "…"


def check_image_output(output: str, count: int, where: str = "--output", videos: bool = False) -> None:
    """An image output (and the out-0.png ... names of `count` images) that can be written: a supported
    suffix and names the file system takes. The longest name is the last one: checking it checks them all."""
    if image_format(output, where, videos) == "VIDEO":
        return
    check_file_name(image_paths(output, count)[-1], where)


def check_metadata_room(output: str, prompt: str, negative_prompt: str | None, where: str) -> None:
    """A JPEG's metadata is one comment segment (64 KiB): a prompt that cannot fit is refused before any work."""
    if image_format(output, where, videos=True) != "JPEG":
        return
    size = len(json.dumps({"prompt": prompt, "negative_prompt": negative_prompt or ""}, ensure_ascii=False).encode())
    if size + METADATA_RESERVE > JPEG_COMMENT_MAX:
        raise UsageError(f"{where} {_short(str(output))}: the prompt is too long for a JPEG's metadata (a comment "
                         f"of at most {JPEG_COMMENT_MAX - METADATA_RESERVE} bytes for the prompts): write .png or .webp.")


class ImagePaths(Sequence):
    """The files `count` outputs are written to: `output` itself for one, else out-0.png, out-1.png, ...
    (the output's suffix; without one `default_suffix`: .png for images, none for videos' frame folders).
    Names are made when asked for, each in O(1): a large count costs nothing until the outputs exist."""

    def __init__(self, output: str | os.PathLike, count: int, default_suffix: str = DEFAULT_IMAGE_SUFFIX,
                 folder: bool = False):
        self.path, self.count = Path(output), count
        # a folder's name keeps its dots (out.v2 -> out.v2-0); a file's suffix goes after the number
        self.stem, self.suffix = (self.path.name, "") if folder else (self.path.stem, self.path.suffix or default_suffix)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.count))]
        if index < 0:
            index += self.count
        if not 0 <= index < self.count:
            raise IndexError(index)
        if self.count == 1:
            return self.path
        return self.path.with_name(f"{self.stem}-{index}{self.suffix}")

    def index_of(self, name: str) -> int | None:
        """Which image a file name (in the output's folder) is, or None: parsed, not searched."""
        if self.count == 1:
            return 0 if name == self.path.name else None
        prefix = f"{self.stem}-"
        if not (name.startswith(prefix) and name.endswith(self.suffix)):
            return None
        digits = name[len(prefix):len(name) - len(self.suffix)]
        if not (digits.isascii() and digits.isdigit()) or (digits != "0" and digits.startswith("0")):
            return None
        number = int(digits)
        return number if number < self.count else None

    def existing(self) -> list[Path]:
        """The paths that exist already (files, folders, links), found with one scan of the folder."""
        folder = self.path.parent if str(self.path.parent) else Path(".")
        if self.count == 1:
            return [self.path] if os.path.lexists(self.path) else []
        try:
            with os.scandir(folder) as entries:
                found = sorted((i, entry.name) for entry in entries if (i := self.index_of(entry.name)) is not None)
        except FileNotFoundError:
            return []
        except OSError:  # a folder that cannot be listed: ask for each name
            return [path for path in self if os.path.lexists(path)]
        return [self[i] for i, _ in found]

    def contains(self, path: str | os.PathLike) -> bool:
        """Whether `path` (any spelling: relative, through links) is one of these files."""
        path = Path(path)
        if self.index_of(path.name) is None:
            return False
        folder = self.path.parent if str(self.path.parent) else Path(".")
        other = path.parent if str(path.parent) else Path(".")
        return folder.resolve() == other.resolve()


def image_paths(output: str | os.PathLike, count: int, default_suffix: str = DEFAULT_IMAGE_SUFFIX,
                folder: bool = False) -> ImagePaths:
    return ImagePaths(output, count, default_suffix, folder)


def existing_image_paths(output: str | os.PathLike, count: int) -> list[Path]:
    """The image outputs of a run of `count` images that exist already: one scan of the folder, whatever the count."""
    return ImagePaths(output, count).existing()


def metadata_json(metadata: dict[str, str], ascii: bool = True) -> str:
    """The metadata as the JSON dmap writes (keys sorted): a JPEG comment, EXIF, a GIF or MP4 comment, a sidecar."""
    return json_text(metadata, sort_keys=True, ensure_ascii=ascii)


def image_save_options(fmt: str, metadata: dict[str, str]) -> dict:
    """Pillow's save options that put the metadata into an image of `fmt`: PNG text chunks; a JPEG (quality 95)
    comment holding the JSON (UTF-8); lossless WebP with the JSON in EXIF ImageDescription; a GIF comment."""
    if fmt == "PNG":
        from PIL.PngImagePlugin import PngInfo  # lazy: PIL (heavy, off start-up)

        info = PngInfo()
        for key, value in metadata.items():
            info.add_text(key, value)
        return {"pnginfo": info}
    text = metadata_json(metadata, ascii=fmt != "JPEG")
    if fmt == "JPEG":
        comment = text.encode("utf-8")
        if len(comment) > JPEG_COMMENT_MAX:  # check_metadata_room refused such prompts before any work
            raise UsageError(f"The metadata ({len(comment)} bytes) does not fit a JPEG comment: write .png or .webp.")
        return {"quality": 95, "comment": comment}
    if fmt == "GIF":
        return {"comment": text.encode("utf-8")}
    from PIL import Image  # lazy: PIL (heavy, off start-up)

    exif = Image.Exif()
    exif[EXIF_IMAGE_DESCRIPTION] = text  # ASCII (JSON escapes the rest): EXIF strings are ASCII
    return {"lossless": True, "exif": exif.tobytes()}


def read_image_metadata(image) -> dict[str, str]:
    """The metadata `image_save_options` put into an open PIL image (PNG, JPEG, WebP or GIF); {} when there is none."""
    text = getattr(image, "text", None)
    if image.format == "PNG":
        return dict(text or {})
    raw = image.info.get("comment") if image.format in ("JPEG", "GIF") else image.getexif().get(EXIF_IMAGE_DESCRIPTION)
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    try:
        data = json.loads(raw) if isinstance(raw, str) else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
