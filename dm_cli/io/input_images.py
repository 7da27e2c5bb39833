"""Input images (`--image PATH`: the image to edit, a reference, a video's first frame), read as hostile input.

Pixels come out as diffusers' `load_image` makes them (Pillow's open, `ImageOps.exif_transpose`, `convert("RGB")`:
16-bit, CMYK, palette and alpha images converted by Pillow, an animated file's first frame), but the file is
treated like every other file dmap reads: a regular file of at most MAX_INPUT_FILE_BYTES (never a FIFO or a
device), one of the raster formats of INPUT_FORMATS (never a format whose plugin runs a program, as EPS runs
Ghostscript), at most MAX_INPUT_PIXELS pixels and MAX_INPUT_SIDE pixels a side (checked from the header, before
any pixel is decoded: a decompression bomb is refused, whatever Pillow's own MAX_IMAGE_PIXELS says), and decoded
in full (a truncated file is refused, not padded with grey). Each refusal is one sentence (UsageError, exit 2)
naming the option and the path, with control characters shown escaped.

Pixels are decoded under one budget shared by every thread of the process (`DECODE_BUDGET`: pixels being decoded at
once, `dmap serve`'s concurrent requests included), and a check that an image decodes (`describe_image`,
`describe_bytes`) keeps no pixels: it decodes in the stored mode (a JPEG at an eighth of its size with Pillow's
`draft`, which still reads every byte), not converted to RGB, and drops them.

The bytes are read once: the digest (`InputImage.digest`, in the metadata and the resume key) is of the very
bytes decoded, and `open_input` refuses a file that changed after `describe_image` read it.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import threading
import warnings
from contextlib import contextmanager

from dm_cli.errors import CheckpointError, UsageError
from dm_cli.inputs import LIMITS, InputImage
from dm_cli.io.checkpoint import open_regular
from dm_cli.units import format_size

# The largest input a run reads: a file of 512 MiB, and 2**27 pixels (134 million: 16384 x 8192, an 11585-pixel
# square), decoded to 384 MiB of RGB. Below Pillow's own bomb error (2 x its MAX_IMAGE_PIXELS, 179 million), so
# every image is refused by this bound and this sentence, not by Pillow's. Sides up to LIMITS (16384), as outputs.
MAX_INPUT_FILE_BYTES = 512 * 2**20
MAX_INPUT_PIXELS = 2**27
MAX_INPUT_SIDE = min(LIMITS["width"], LIMITS["height"])
# Raster formats whose Pillow plugins decode in-process (no EPS: Ghostscript; no PDF, no fonts, no plugins
# that shell out). What Pillow lacks a codec for (AVIF without libavif) is refused as not an image.
INPUT_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF", "PPM", "TGA", "AVIF")


# Pixels decoded at once, across all threads, when nothing sized the budget: two of the largest input images.
DEFAULT_DECODE_PIXELS = 2 * MAX_INPUT_PIXELS
# Pillow allocates pixels in blocks of 16 MiB by default, below glibc's dynamic mmap threshold (up to 32 MiB): a large
# image's blocks, once freed, stay in the decoding thread's malloc arena (tens of MiB for each thread of dmap serve's
# pool). Blocks of 64 MiB are mapped and unmapped whole, so a decoded image's memory goes back when it is dropped.
# Not when the user set PILLOW_BLOCK_SIZE.
PIXEL_BLOCK_BYTES = 64 * 2**20
# Bytes a decoded pixel may take while it is decoded and converted: a 4-byte mode (RGBA, CMYK, I) and its RGB copy.
DECODE_BYTES_PER_PIXEL = 8


class DecodeBudget:
    """Pixels being decoded at once, across threads: a decode waits until its pixels fit beside the others' (one image
    larger than the whole budget decodes alone). `peak` is the most ever held at once (what a test measures)."""

    def __init__(self, pixels: int = DEFAULT_DECODE_PIXELS):
        self.pixels = pixels
        self.in_use = 0
        self.peak = 0
        self._cond = threading.Condition()

    def resize(self, pixels: int) -> None:
        """A new size (at least one largest input image); waiting decodes look again."""
        with self._cond:
            self.pixels = max(int(pixels), MAX_INPUT_PIXELS)
            self._cond.notify_all()

    @contextmanager
    def hold(self, pixels: int):
        with self._cond:
            self._cond.wait_for(lambda: self.in_use == 0 or self.in_use + pixels <= self.pixels)
            self.in_use += pixels
            self.peak = max(self.peak, self.in_use)
        try:
            yield
        finally:
            with self._cond:
                self.in_use -= pixels
                self._cond.notify_all()


DECODE_BUDGET = DecodeBudget()


def size_decode_budget(room_bytes: int) -> int:
    """Size DECODE_BUDGET from the memory a process may spend on decoding (`dmap serve`: a share of the RAM its plan
    leaves): that many bytes at DECODE_BYTES_PER_PIXEL, at least one largest input image. Returns the pixels."""
    DECODE_BUDGET.resize(max(0, int(room_bytes)) // DECODE_BYTES_PER_PIXEL)
    return DECODE_BUDGET.pixels


def shown_path(path) -> str:
    """A path for a message: control characters and lone surrogates escaped (`\\x1b`), never raw, at most
    about 120 characters."""
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 120 else f"{text[:80]}...{text[-32:]}"


def read_image(path, where: str = "--image"):
    """The RGB PIL image of the file at `path`, as diffusers' load_image reads it; UsageError (one sentence
    naming `where` and the path) for anything that is not a readable image within the bounds."""
    return _decode(_read_bytes(path, where), path, where)


def describe_image(path, where: str = "--image") -> InputImage:
    """What a plan and a run know of an input image: its size after EXIF orientation, its path and the sha256 of
    its bytes. Refuses exactly what `read_image` refuses: the bounds come from the header, but a truncated file
    shows only when decoded, so the image is decoded in full (and its pixels dropped at once)."""
    data = _read_bytes(path, where)
    width, height = _check_decodes(data, path, where)
    return InputImage(width, height, os.fspath(path), hashlib.sha256(data).hexdigest())


def describe_bytes(data: bytes, name: str, where: str) -> InputImage:
    """An input image received in memory (`dmap serve`'s base64 inputs), refused exactly as `read_image` refuses a
    file, kept as its encoded bytes (`InputImage.encoded`, decoded again only when its batch runs: a queued request
    holds kilobytes, not its decoded pixels); its digest is of those bytes, as a file's is."""
    if len(data) > MAX_INPUT_FILE_BYTES:
        raise UsageError(f"{where} {name} is {format_size(len(data))}, more than the "
                         f"{format_size(MAX_INPUT_FILE_BYTES)} an input image may have.")
    width, height = _check_decodes(data, name, where)
    return InputImage(width, height, None, hashlib.sha256(data).hexdigest(), encoded=data)


def open_input(image: InputImage, where: str = "--image"):
    """The RGB pixels of an input image at run time: its in-memory pixels (the API's PIL image), else its file,
    which must still have the digest `describe_image` recorded (else the metadata would name another image)."""
    if image.pixels is not None:
        return image.pixels
    if image.encoded is not None:  # received in memory (dmap serve): checked when received, decoded now
        return _decode(image.encoded, "(base64)", where)
    if image.path is None:
        raise UsageError(f"{where} gives only a size ({image.width}x{image.height}): a run needs the image file.")
    data = _read_bytes(image.path, where)
    if image.digest is not None and hashlib.sha256(data).hexdigest() != image.digest:
        raise UsageError(f"{where} {shown_path(image.path)} changed after dmap read it (its sha256 differs): "
                         "run again to read the new image.")
    decoded = _decode(data, image.path, where)
    if decoded.size != image.size:
        raise UsageError(f"{where} {shown_path(image.path)} is {decoded.width}x{decoded.height} pixels now, "
                         f"not {image.width}x{image.height}: run again to read the new image.")
    return decoded


# `PATH@FRAME` or `PATH@FRAME:STRENGTH` (LTX-2's keyframes): the suffix after the last '@'
_KEYFRAME_RE = re.compile(r"^([0-9]{1,6})(?::([0-9]{0,3}(?:\.[0-9]{1,12})?))?$")


def split_keyframe(text: str, where: str = "--image") -> tuple[str, int | None, float | None]:
    """(path, frame, strength) of `PATH`, `PATH@FRAME` or `PATH@FRAME:STRENGTH`. '@' may be part of a real path:
    the text is split only when it is not itself an existing file and the suffix after its last '@' is FRAME or
    FRAME:STRENGTH (FRAME a whole number, STRENGTH a decimal number); a suffix that is neither, after an existing
    file, is refused in one sentence (a typo, not a file name)."""
    head, at, suffix = text.rpartition("@")
    if not at or not head or os.path.lexists(text):
        return text, None, None
    match = _KEYFRAME_RE.match(suffix)
    if match is None or match.group(2) == "":
        if os.path.lexists(head):
            raise UsageError(f"{where} {shown_path(text)}: after '@' give the frame index, a whole number, and "
                             "optionally ':' and a strength (PATH@FRAME or PATH@FRAME:STRENGTH, such as a.png@9:0.8).")
        return text, None, None
    strength = float(match.group(2)) if match.group(2) is not None else None
    return head, int(match.group(1)), strength


_SIZE_RE = re.compile(r"^\s*([0-9]{1,6})\s*[xX]\s*([0-9]{1,6})\s*$")


def parse_image_size(text, where: str = "--image-size") -> InputImage:
    """An input image's size only (`dmap plan --image-size 1024x768`: WIDTHxHEIGHT), for plans made before the
    image exists."""
    match = _SIZE_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise UsageError(f"{where} must be WIDTHxHEIGHT in pixels, such as 1024x768, not {shown_path(text)!r}.")
    width, height = int(match.group(1)), int(match.group(2))
    _check_bounds(width, height, f"{where} {width}x{height}")
    return InputImage(width, height)


# --- the reader ----------------------------------------------------------------------------------------


def _read_bytes(path, where: str) -> bytes:
    shown = shown_path(path)
    try:
        path = os.fspath(path)
    except TypeError:
        raise UsageError(f"{where} takes a file path, not a {type(path).__name__}.") from None
    if not path:
        raise UsageError(f"{where} needs a file path, not an empty string.")
    if not os.path.lexists(path):
        raise UsageError(f"{where} {shown} does not exist.")
    if os.path.isdir(path):
        raise UsageError(f"{where} {shown} is a folder, not an image file.")
    try:
        handle, size = open_regular(path, "input image")
    except CheckpointError:
        raise UsageError(f"{where} {shown} is not a regular file (a FIFO, device or dangling link): give an image "
                         "file.") from None
    if size > MAX_INPUT_FILE_BYTES:
        handle.close()
        raise UsageError(f"{where} {shown} is {format_size(size)}, more than the {format_size(MAX_INPUT_FILE_BYTES)} "
                         "an input image may have.")
    try:
        with handle:
            data = handle.read(MAX_INPUT_FILE_BYTES + 1)
    except OSError as error:
        raise UsageError(f"{where} {shown} cannot be read: {error.strerror or error}.") from None
    if len(data) > MAX_INPUT_FILE_BYTES:  # it grew while read
        raise UsageError(f"{where} {shown} is more than the {format_size(MAX_INPUT_FILE_BYTES)} an input image may have.")
    return data


def _check_bounds(width: int, height: int, what: str) -> None:
    if width < 1 or height < 1:
        raise UsageError(f"{what} has no pixels.")
    if width > MAX_INPUT_SIDE or height > MAX_INPUT_SIDE or width * height > MAX_INPUT_PIXELS:
        raise UsageError(f"{what} is {width}x{height} pixels, more than an input image may have (at most "
                         f"{MAX_INPUT_SIDE} a side and {MAX_INPUT_PIXELS:,} pixels): give a smaller image.")


def _decode(data: bytes, path, where: str):
    """Header first (format, bounds), then the first frame decoded in full (under DECODE_BUDGET), EXIF-transposed
    and converted to RGB."""
    return _decoded(data, path, where, check_only=False)


def _check_decodes(data: bytes, path, where: str) -> tuple[int, int]:
    """(width, height) after EXIF orientation of an image that decodes in full, as `_decode` would refuse it; its
    pixels decoded in the stored mode (a JPEG at an eighth of its size: `draft` still reads every byte) and dropped."""
    return _decoded(data, path, where, check_only=True)


def _decoded(data: bytes, path, where: str, check_only: bool):
    from PIL import ImageOps  # lazy: PIL (heavy, off start-up)

    image = _opened(data, path, where)
    with DECODE_BUDGET.hold(image.width * image.height):
        size = image.size
        if check_only and image.format in ("JPEG", "MPO"):
            image.draft(image.mode, (1, 1))  # DCT scaling: an eighth a side, every byte still decoded
        _loaded(image, path, where)
        if check_only:
            orientation = image.getexif().get(0x0112)  # after load: a PNG's eXIf chunk may follow its pixels
            return size[::-1] if orientation in (5, 6, 7, 8) else size
        image = ImageOps.exif_transpose(image)  # each step drops the previous full-size copy
        return image if image.mode == "RGB" else image.convert("RGB")


def _loaded(image, path, where: str) -> None:
    from PIL import Image  # lazy: PIL (heavy, off start-up)

    shown = shown_path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image.load()  # the first frame (an animated file's, as load_image takes it), decoded in full
        except (OSError, ValueError, SyntaxError, EOFError, IndexError, KeyError) as error:
            raise UsageError(f"{where} {shown} is truncated or damaged ({_reason(error)}): give a complete "
                             "image file.") from None
        except Image.DecompressionBombError:  # a frame or a tile larger than the header said
            raise UsageError(f"{where} {shown} decodes to more pixels than an input image may have (at most "
                             f"{MAX_INPUT_PIXELS:,}): give a smaller image.") from None


def _opened(data: bytes, path, where: str):
    """The image's header read (format, bounds), no pixel decoded."""
    from PIL import Image, UnidentifiedImageError  # lazy: PIL (heavy, off start-up)

    if "PILLOW_BLOCK_SIZE" not in os.environ and Image.core.get_block_size() < PIXEL_BLOCK_BYTES:
        Image.core.set_block_size(PIXEL_BLOCK_BYTES)

    shown = shown_path(path)
    with warnings.catch_warnings():
        # the bounds below are dmap's (Pillow warns from 89 million pixels, before MAX_INPUT_PIXELS)
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            Image.init()
            image = Image.open(io.BytesIO(data), formats=[f for f in INPUT_FORMATS if f in Image.OPEN])
        except Image.DecompressionBombError:
            raise UsageError(f"{where} {shown} declares more pixels than an input image may have (at most "
                             f"{MAX_INPUT_PIXELS:,}): give a smaller image.") from None
        except UnidentifiedImageError:
            raise UsageError(f"{where} {shown} is not an image dmap reads ({', '.join(INPUT_FORMATS[:-1])} or "
                             f"{INPUT_FORMATS[-1]}).") from None
        except (OSError, ValueError, SyntaxError, EOFError) as error:
            raise UsageError(f"{where} {shown} is truncated or damaged ({_reason(error)}): give a complete "
                             "image file.") from None
        _check_bounds(image.width, image.height, f"{where} {shown}")
        return image


def _reason(error: BaseException) -> str:
    text = shown_path(str(error) or type(error).__name__).rstrip(".")
    return text[:100]
