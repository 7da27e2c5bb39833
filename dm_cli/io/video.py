"""Write generated videos: MP4, animated WebP or GIF, or a folder of PNG frames, with their metadata.

- `.mp4`: diffusers' `export_to_video` (imageio with the ffmpeg binary that the pinned `imageio-ffmpeg`
  wheel ships: no system ffmpeg), then the metadata is added as the container's `comment` tag by a
  stream copy with the same binary (no re-encoding);
- `.webp`: animated, lossless (frames read back are the generated pixels), metadata in EXIF
  ImageDescription; `.gif`: animated (256-colour palette), metadata in the GIF comment — both with
  Pillow, no extra dependency;
- a folder (`out/`, or a path without a suffix): `frame-00000.png`, ... with PNG text metadata.

Every output also gets a JSON sidecar (`out.mp4.json`; `out/metadata.json` for a folder). Files are
written under a temporary name beside the result and renamed when complete; a folder is filled
under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from dm_cli.errors import UsageError
from dm_cli.io.atomic import _umask, atomic_write
from dm_cli.io.swap import TEMP_MARK, hidden_name, publish

VIDEO_SUFFIXES = (".mp4", ".webp", ".gif")
EXIF_IMAGE_DESCRIPTION = 0x010E


def video_kind(output: str) -> str:
    """"mp4", "webp", "gif" or "frames" (a folder); anything else is refused with the accepted forms."""
    path = Path(output)
    suffix = path.suffix.lower()
    if suffix in VIDEO_SUFFIXES:
        return suffix[1:]
    if output.endswith(("/", os.sep)) or path.is_dir() or not suffix:
        return "frames"
    raise UsageError(f"Cannot write a video to '{output}': use out.mp4, out.webp, out.gif or a folder (out/) for PNG frames.")


def sidecar_path(output: str) -> Path:
    return Path(output) / "metadata.json" if video_kind(output) == "frames" else Path(output + ".json")


def to_uint8(frames):
    """Float frames in [0, 1] (diffusers' `output_type="np"`) to uint8, rounding to nearest (one rule for all outputs)."""
    import numpy as np

    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def save_video(frames, output: str, fps: int, metadata: dict[str, str], overwrite: bool = False) -> list[str]:
    """Write uint8 frames (F, H, W, 3) to `output`; returns the written paths (the video, then the sidecar).

    A frames folder that exists and is not empty is replaced only with `overwrite` (after the new one is complete).
    """
    kind = video_kind(output)
    path = Path(output.rstrip("/" + os.sep)) if kind == "frames" else Path(output)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"Cannot write {output}: folder {parent} does not exist.")
    if fps < 1:
        raise UsageError(f"--fps must be at least 1 (got {fps}).")
    from PIL import Image

    images = [Image.fromarray(frame) for frame in frames]
    text = json.dumps(metadata, sort_keys=True)
    if kind == "frames":
        _write_frames(images, path, metadata, text, overwrite)
        return [str(path), str(path / "metadata.json")]
    if kind == "mp4":
        atomic_write(path, lambda tmp: _write_mp4(images, tmp, fps, text))
    elif kind == "webp":
        exif = Image.Exif()
        exif[EXIF_IMAGE_DESCRIPTION] = text
        atomic_write(path, lambda tmp: images[0].save(
            tmp, format="WEBP", save_all=True, append_images=images[1:], duration=_duration_ms(fps), loop=0,
            lossless=True, exif=exif.tobytes()))
    else:
        atomic_write(path, lambda tmp: images[0].save(
            tmp, format="GIF", save_all=True, append_images=images[1:], duration=_duration_ms(fps), loop=0,
            comment=text.encode("utf-8")))
    sidecar = Path(output + ".json")
    atomic_write(sidecar, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))
    return [str(path), str(sidecar)]


def _duration_ms(fps: int) -> int:
    return max(1, round(1000 / fps))


def _write_frames(images, folder: Path, metadata: dict[str, str], text: str, overwrite: bool) -> None:
    from PIL.PngImagePlugin import PngInfo

    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} exists and is not a folder: give a folder for the frames.")
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise UsageError(f"{folder} exists and is not an empty folder: give a new folder or add --overwrite.")
    info = PngInfo()
    for key, value in metadata.items():
        info.add_text(key, value)
    staging = hidden_name(folder, TEMP_MARK)  # a kill leaves a folder the next shard/run of it removes
    staging.mkdir()
    try:
        for index, image in enumerate(images):
            image.save(staging / f"frame-{index:05d}.png", format="PNG", pnginfo=info)
        (staging / "metadata.json").write_text(text + "\n", encoding="utf-8")
        os.chmod(staging, 0o777 & ~_umask())
        if folder.exists() and not overwrite:
            try:
                folder.rmdir()  # empty (checked above): nothing is lost
            except OSError:
                raise UsageError(f"{folder} is no longer empty: something wrote into it meanwhile; it was left as "
                                 "it is.") from None
        publish(staging, folder, overwrite)  # claimed atomically, or swapped with --overwrite (dm_cli.io.swap)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_mp4(images, tmp: str, fps: int, comment: str) -> None:
    """export_to_video encodes (H.264 via imageio-ffmpeg); a stream copy adds the comment tag."""
    try:
        import imageio_ffmpeg
        from diffusers.utils import export_to_video
    except ImportError as error:
        raise UsageError(f"Writing MP4 needs imageio and imageio-ffmpeg ({error}): reinstall dmap's pinned "
                         "requirements, or write .webp, .gif or a folder of PNG frames.") from None
    encoded = tmp + ".encode.mp4"
    try:
        export_to_video(images, encoded, fps=fps)
        ffmpeg = imageio_ffmpeg.get_ffmpeg_exe()
        done = subprocess.run([ffmpeg, "-y", "-loglevel", "error", "-i", encoded, "-map", "0", "-c", "copy",
                               "-metadata", f"comment={comment}", "-f", "mp4", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise UsageError(f"ffmpeg could not write the MP4 metadata: {done.stderr.strip()[:200]}")
    finally:
        if os.path.exists(encoded):
            os.unlink(encoded)


def read_metadata(path: str) -> dict:
    """The metadata a written video carries in the file itself (tests and users' scripts)."""
    kind = video_kind(path)
    if kind == "frames":
        from PIL import Image

        first = sorted(Path(path).glob("frame-*.png"))[0]
        with Image.open(first) as image:
            return dict(image.text)
    if kind == "webp":
        from PIL import Image

        with Image.open(path) as image:
            return json.loads(image.getexif()[EXIF_IMAGE_DESCRIPTION])
    if kind == "gif":
        from PIL import Image

        with Image.open(path) as image:
            return json.loads(image.info["comment"])
    import imageio_ffmpeg

    done = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-i", path, "-f", "ffmetadata", "-"],
                          capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("comment="):
            return json.loads(line[len("comment="):].replace("\\=", "=").replace("\\;", ";").replace("\\#", "#")
                              .replace("\\\\", "\\"))
    return {}
