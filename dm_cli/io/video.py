"""Video outputs, one part of dm_cli.io.outputs: which kind a name is, its sidecar, and what Pillow cannot do.

- `.mp4`: diffusers' `export_to_video` (imageio with the ffmpeg binary that the pinned `imageio-ffmpeg`
  wheel ships: no system ffmpeg), then the metadata is added as the container's `comment` tag by a
  stream copy with the same binary (no re-encoding); read back (and decoded whole, for resume) with it;
- `.webp`: animated, lossless (frames read back are the generated pixels), metadata in EXIF
  ImageDescription; `.gif`: animated (256-colour palette), metadata in the GIF comment — both with
  Pillow (dm_cli.io.images has the metadata encodings), no extra dependency;
- a folder (`out/`, or a path without a suffix): `frame-00000.png`, ... with PNG text metadata.

Every output also gets a JSON sidecar (`out.mp4.json`; `out/metadata.json` for a folder). Files are
written under a temporary name beside the result and renamed when complete; a folder is filled
under a temporary name and renamed into place. The writers are dm_cli.io.outputs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

from dm_cli.errors import UsageError
from dm_cli.io.atomic import _umask
from dm_cli.io.swap import TEMP_MARK, hidden_name, publish

VIDEO_SUFFIXES = (".mp4", ".webp", ".gif")
FRAME_FORMAT, FRAME_SUFFIX = "PNG", ".png"  # a frames folder's files (dm_cli.io.atomic knows their names too)
FRAME_NAME = re.compile(r"frame-([0-9]{5,})" + re.escape(FRAME_SUFFIX))
FOLDER_SIDECAR = "metadata.json"


def names_folder(output: str | os.PathLike) -> bool:
    """A trailing slash names a folder whatever dots its name holds (`out.v2/`, `u0.875/`); so does a folder that
    exists. One rule for every place that reads an output's kind from its name."""
    text = os.fspath(output)
    return text.endswith(("/", os.sep)) or os.path.isdir(text)


def video_kind(output: str) -> str:
    """"mp4", "webp", "gif" or "frames" (a folder); anything else is refused with the accepted forms."""
    if names_folder(output):
        return "frames"
    suffix = Path(output).suffix.lower()
    if suffix in VIDEO_SUFFIXES:
        return suffix[1:]
    if not suffix:
        return "frames"
    raise UsageError(f"Cannot write a video to '{output}': use out.mp4, out.webp, out.gif or a folder (out/) for PNG frames.")


def sidecar_path(output: str) -> Path:
    return Path(output) / FOLDER_SIDECAR if video_kind(output) == "frames" else Path(output + ".json")


def to_uint8(frames):
    """Float frames in [0, 1] (diffusers' `output_type="np"`) to uint8, rounding to nearest (one rule for all outputs)."""
    import numpy as np  # lazy: numpy (heavy, off start-up)

    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def duration_ms(fps: int) -> int:
    return max(1, round(1000 / fps))


def frame_name(index: int) -> str:
    return f"frame-{index:05d}{FRAME_SUFFIX}"


def frame_files(folder: Path) -> list[Path]:
    """A frames folder's frames in order; a gap in their numbers (a frame lost) is a ValueError."""
    numbered = sorted((int(m.group(1)), name) for name in os.listdir(folder) if (m := FRAME_NAME.fullmatch(name)))
    if [number for number, _ in numbered] != list(range(len(numbered))):
        raise ValueError(f"{folder}: the frames are not numbered 0 to {len(numbered) - 1}")
    return [folder / name for _, name in numbered]


def write_frames_folder(images, folder: Path, text: str, options: dict, overwrite: bool, audio=None) -> None:
    """Each PIL image as a frame (`options`: Pillow's, with the metadata) and `text` as metadata.json, filled in
    a hidden folder that is then claimed atomically (or swapped in whole with `overwrite`). `audio`: (waveform,
    sample rate), written as AUDIO_NAME beside the frames."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} exists and is not a folder: give a folder for the frames.")
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise UsageError(f"{folder} exists and is not an empty folder: give a new folder or add --overwrite.")
    staging = hidden_name(folder, TEMP_MARK)  # a kill leaves a folder the next shard/run of it removes
    staging.mkdir()
    try:
        for index, image in enumerate(images):
            image.save(staging / frame_name(index), format=FRAME_FORMAT, **options)
        (staging / FOLDER_SIDECAR).write_text(text + "\n", encoding="utf-8")
        if audio is not None:
            write_wav(staging / AUDIO_NAME, *audio)
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


def write_mp4(images, tmp: str, fps: int, comment: str, audio=None) -> None:
    """export_to_video encodes (H.264 via imageio-ffmpeg); a stream copy adds the comment tag. `audio`:
    (waveform, sample rate), muxed in the same step as an AAC track."""
    try:  # lazy: imageio_ffmpeg (optional), diffusers (heavy, off start-up)
        import imageio_ffmpeg
        from diffusers.utils import export_to_video
    except ImportError as error:
        raise UsageError(f"Writing MP4 needs imageio and imageio-ffmpeg ({error}): reinstall dmap's pinned "
                         "requirements, or write .webp, .gif or a folder of PNG frames.") from None
    encoded, wav = tmp + ".encode.mp4", tmp + ".audio.wav"
    try:
        export_to_video(images, encoded, fps=fps)
        ffmpeg = imageio_ffmpeg.get_ffmpeg_exe()
        streams = ["-i", encoded, "-map", "0", "-c", "copy"]
        if audio is not None:
            write_wav(wav, *audio)
            streams = ["-i", encoded, "-i", wav, "-map", "0:v", "-map", "1:a", "-c:v", "copy", "-c:a", "aac"]
        done = subprocess.run([ffmpeg, "-y", "-loglevel", "error", *streams,
                               "-metadata", f"comment={comment}", "-f", "mp4", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise UsageError(f"ffmpeg could not write the MP4 metadata: {done.stderr.strip()[:200]}")
    finally:
        for path in (encoded, wav):
            if os.path.exists(path):
                os.unlink(path)


def read_mp4_metadata(path: str | os.PathLike) -> dict:
    """The JSON in an MP4's comment tag ({} when there is none), read with imageio-ffmpeg's binary."""
    import imageio_ffmpeg  # lazy: imageio_ffmpeg (optional)

    done = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-i", str(path), "-f", "ffmetadata",
                           "-"], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("comment="):
            return json.loads(line[len("comment="):].replace("\\=", "=").replace("\\;", ";").replace("\\#", "#")
                              .replace("\\\\", "\\"))
    return {}


def probe_mp4(path: str | os.PathLike) -> tuple[int, tuple[int, int]]:
    """(frames, (width, height)) of an MP4's video, decoding every frame: a damaged file is a ValueError."""
    import imageio_ffmpeg  # lazy: imageio_ffmpeg (optional)

    done = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-xerror", "-i", str(path),
                           "-map", "0:v:0", "-f", "framemd5", "-"], capture_output=True, text=True)
    size = re.search(r"^#dimensions 0: (\d+)x(\d+)$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or done.stderr.strip() or size is None:
        raise ValueError(f"{path}: ffmpeg cannot decode it: {done.stderr.strip()[:200]}")
    frames = sum(1 for line in done.stdout.splitlines() if line and not line.startswith("#"))
    return frames, (int(size.group(1)), int(size.group(2)))


# --- audio tracks (LTX-2): a video's frames carry their waveform to the writers -----------------------

AUDIO_NAME = "audio.wav"  # a frames folder's audio track, beside the PNGs


def with_audio(frames, wave, sample_rate: int):
    """`frames` (uint8, (F, H, W, 3)) as an array that also carries `wave` (float, (channels, samples)) and its
    sample rate: every writer takes it where it takes frames."""
    import numpy as np  # lazy: numpy (heavy, off start-up)

    out = np.asarray(frames).view(_frames_class())
    out.audio, out.sample_rate = np.asarray(wave, dtype=np.float32), int(sample_rate)
    return out


_FRAMES_CLASS: list = []  # made on first use: numpy is not imported with dm_cli.io.video


def _frames_class():
    if not _FRAMES_CLASS:
        import numpy as np  # lazy: numpy (heavy, off start-up)

        class VideoFrames(np.ndarray):
            """uint8 frames with an audio track (`audio`, `sample_rate`); slices and single frames drop it."""

            def __array_finalize__(self, obj):
                self.audio = self.sample_rate = None

        _FRAMES_CLASS.append(VideoFrames)
    return _FRAMES_CLASS[0]


def audio_of(frames) -> tuple | None:
    """(waveform (channels, samples) float32, sample rate) of frames made by `with_audio`, else None."""
    wave = getattr(frames, "audio", None)
    return None if wave is None else (wave, frames.sample_rate)


def write_wav(path, wave, sample_rate: int) -> None:
    """A 32-bit float WAV (format 3, IEEE float): the samples exactly as generated, channels interleaved."""
    import numpy as np  # lazy: numpy (heavy, off start-up)

    samples = np.ascontiguousarray(np.asarray(wave, dtype="<f4").T)  # (samples, channels)
    channels = samples.shape[1] if samples.ndim == 2 else 1
    data = samples.tobytes()
    header = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, 3, channels, sample_rate, sample_rate * channels * 4, channels * 4, 32)
    header += b"data" + struct.pack("<I", len(data))
    with open(path, "wb") as handle:
        handle.write(header + data)


def read_wav(path) -> tuple:
    """(waveform (channels, samples) float32, sample rate) of a WAV `write_wav` wrote; ValueError otherwise."""
    import numpy as np  # lazy: numpy (heavy, off start-up)

    raw = Path(path).read_bytes()
    if raw[:4] != b"RIFF" or raw[8:12] != b"WAVE" or raw[12:16] != b"fmt ":
        raise ValueError(f"{path}: not a WAV file")
    _, fmt, channels, rate, _, _, bits = struct.unpack("<IHHIIHH", raw[16:36])
    if fmt != 3 or bits != 32 or raw[36:40] != b"data":
        raise ValueError(f"{path}: not a 32-bit float WAV")
    size = struct.unpack("<I", raw[40:44])[0]
    return np.frombuffer(raw[44:44 + size], dtype="<f4").reshape(-1, channels).T.copy(), rate
