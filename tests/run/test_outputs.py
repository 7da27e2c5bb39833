"""dm_cli.io.outputs: one writer and one resume check (`is_complete`) for every kind a run writes.

Tiny outputs (8x8, 2-3 frames): cheap enough for CI. MP4 needs imageio-ffmpeg and diffusers (skipped without).
"""

from __future__ import annotations

import json

import pytest

from dm_cli.errors import UsageError
from dm_cli.io.outputs import (
    IMAGE_KINDS,
    LATENTS,
    VIDEO_KINDS,
    is_complete,
    output_kind,
    read_metadata,
    save_images,
    save_latents,
    save_video,
    save_videos,
)

META = {"prompt": "a fox; x=1 ünï", "seed": "3", "steps": "2", "guidance_scale": "3.5", "height": "8", "width": "8",
        "source": "demo", "plan_digest": "0123456789abcdef", "dmap_version": "0.1.0"}
VIDEO_META = {**META, "num_frames": "3", "fps": "8"}


def _frames(count=3, size=8):
    import numpy as np

    return np.random.default_rng(0).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def test_kinds_by_suffix_and_pipeline():
    assert output_kind("x.png") is IMAGE_KINDS["PNG"] and output_kind("x") is IMAGE_KINDS["PNG"]
    assert output_kind("x.JPEG") is IMAGE_KINDS["JPEG"] and IMAGE_KINDS["JPEG"].suffixes == (".jpg", ".jpeg")
    assert output_kind("x.webp").name == "webp" and output_kind("x.webp", video=True).name == "animated webp"
    assert output_kind("out/", video=True) is VIDEO_KINDS["frames"] and VIDEO_KINDS["frames"].folder
    with pytest.raises(UsageError, match=r"dmap writes images as \.png, \.jpg, \.jpeg or \.webp"):
        output_kind("x.gif")
    with pytest.raises(UsageError, match="out.mp4, out.webp, out.gif or a folder"):
        output_kind("x.avi", video=True)


@pytest.mark.parametrize("name", ["v.webp", "v.gif", "frames"])
def test_every_video_kind_resumes(tmp_path, name):
    path = tmp_path / name
    written = save_video(_frames(), str(path), 8, VIDEO_META)
    assert read_metadata(path) == VIDEO_META
    assert is_complete(path, VIDEO_META) == (True, "complete")
    assert is_complete(path, {**VIDEO_META, "plan_digest": "other"}) == (True, "complete")
    assert is_complete(path, {**VIDEO_META, "seed": "4"}) == (False, "made for another seed")
    assert is_complete(path, {**VIDEO_META, "fps": "16"}) == (False, "made for another fps")
    assert is_complete(path, {**VIDEO_META, "width": "16"}) == (False, "made for another width")
    assert is_complete(tmp_path / "missing.webp", VIDEO_META) == (False, "missing")
    sidecar = written[1]
    (tmp_path / sidecar.rsplit("/", 1)[1] if name != "frames" else path / "metadata.json").unlink()
    assert is_complete(path, VIDEO_META) == (False, "no sidecar")  # killed between the video and its sidecar


def test_a_damaged_or_short_video_is_redone(tmp_path):
    save_video(_frames(), str(tmp_path / "v.webp"), 8, VIDEO_META)
    data = (tmp_path / "v.webp").read_bytes()
    (tmp_path / "v.webp").write_bytes(data[: len(data) // 2])
    assert is_complete(tmp_path / "v.webp", VIDEO_META) == (False, "unreadable")
    save_video(_frames(2), str(tmp_path / "two.webp"), 8, VIDEO_META)  # the metadata says 3 frames
    assert is_complete(tmp_path / "two.webp", VIDEO_META) == (False, "made for another frame count")
    save_video(_frames(), str(tmp_path / "frames"), 8, VIDEO_META)
    (tmp_path / "frames" / "frame-00001.png").unlink()  # a gap
    assert is_complete(tmp_path / "frames", VIDEO_META) == (False, "unreadable")
    save_images([_image()], str(tmp_path / "still.webp"), VIDEO_META)  # an image where a video belongs
    assert is_complete(tmp_path / "still.webp", VIDEO_META)[0] is False
    assert is_complete(tmp_path / "v.avi", VIDEO_META) == (False, "missing")


def _image():
    from PIL import Image

    return Image.fromarray(_frames(1)[0])


@pytest.mark.parametrize("suffix", [".png", ".jpg", ".webp"])
def test_images_resume_and_read_back(tmp_path, suffix):
    written = save_images([_image(), _image()], str(tmp_path / f"many{suffix}"), META)
    assert [p.rsplit("/", 1)[1] for p in written] == [f"many-0{suffix}", f"many-1{suffix}"]
    assert read_metadata(written[1]) == META
    assert is_complete(written[1], META) == (True, "complete")
    assert is_complete(written[1], {**META, "num_frames": "3"})[0] is False  # a video was expected


def test_latents_resume(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "z.safetensors"
    assert save_latents(torch.zeros(1, 4, 2, 2), str(path), META) == str(path)
    assert read_metadata(path) == META
    assert is_complete(path, META) == (True, "complete")
    assert is_complete(path, {**META, "steps": "9"}) == (False, "made for another steps")
    path.write_bytes(path.read_bytes()[:-4])
    assert is_complete(path, META) == (False, "unreadable")


def test_several_videos_are_numbered_and_a_missing_folder_is_refused(tmp_path):
    written = save_videos([_frames(), _frames()], str(tmp_path / "v.gif"), 8, VIDEO_META)
    assert [p.rsplit("/", 1)[1] for p in written] == ["v-0.gif", "v-0.gif.json", "v-1.gif", "v-1.gif.json"]
    assert json.loads((tmp_path / "v-1.gif.json").read_text()) == VIDEO_META
    for write in (lambda out: save_video(_frames(), out + ".gif", 8, VIDEO_META),
                  lambda out: save_images([_image()], out + ".png", META)):
        with pytest.raises(UsageError, match="folder .*nowhere does not exist"):
            write(str(tmp_path / "nowhere" / "x"))
    assert LATENTS.suffixes == (".safetensors",)


def test_mp4_resumes(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    pytest.importorskip("diffusers")
    path, meta = tmp_path / "v.mp4", {**VIDEO_META, "height": "16", "width": "16"}  # H.264's 16-pixel blocks
    save_video(_frames(size=16), str(path), 8, meta)
    assert read_metadata(path) == meta
    assert is_complete(path, meta) == (True, "complete")
    assert is_complete(path, {**meta, "num_frames": "4"}) == (False, "made for another num frames")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert is_complete(path, meta) == (False, "unreadable")


def test_a_trailing_slash_names_a_frames_folder_whatever_dots_its_name_holds(tmp_path):
    """Issue 31: `--output renders/u0.875/` was refused as a '.875' image; a folder that exists is one too."""
    from dm_cli.errors import UsageError
    from dm_cli.io.images import image_format
    from dm_cli.io.video import video_kind
    from dm_cli.run.settle.settle import check_run_request

    for name in ("renders/u0.875/", "out.v2/", "run-0.5/", "out.mp4/", "plain/"):
        assert video_kind(name) == "frames", name
        assert image_format(name, videos=True) == "VIDEO", name
        with pytest.raises(UsageError, match="names a folder: image pipelines write a file"):
            image_format(name)
    existing = tmp_path / "take.v3"
    existing.mkdir()
    assert video_kind(str(existing)) == "frames" and image_format(str(existing), videos=True) == "VIDEO"
    (tmp_path / "renders").mkdir()
    check_run_request(str(tmp_path / "renders" / "u0.875") + "/", None, None, 0, "auto")  # accepted before loading
    assert video_kind("clip.mp4") == "mp4" and image_format("shot.webp") == "WEBP"
    with pytest.raises(UsageError, match="not '.875'"):
        image_format("renders/u0.875")  # without the slash (and not a folder): a suffix, refused


def test_several_videos_into_a_dotted_folder_keep_its_name(tmp_path):
    import numpy as np

    from dm_cli.io.outputs import save_videos

    frames = np.zeros((3, 8, 8, 3), dtype=np.uint8)
    written = save_videos([frames, frames], str(tmp_path / "u0.875") + "/", fps=8, metadata={"prompt": "x"})
    assert {p.name for p in tmp_path.iterdir()} == {"u0.875-0", "u0.875-1"}
    assert all((tmp_path / name / "frame-00002.png").is_file() for name in ("u0.875-0", "u0.875-1")), written


def test_an_existing_empty_folder_is_a_frames_output_before_loading(tmp_path):
    from dm_cli.errors import UsageError
    from dm_cli.run.settle.settle import check_run_request

    (tmp_path / "out.v2").mkdir()
    check_run_request(str(tmp_path / "out.v2") + "/", None, None, 0, "auto")
    check_run_request(str(tmp_path / "out.v2"), None, None, 0, "auto")
    with pytest.raises(UsageError, match="does not exist"):
        check_run_request(str(tmp_path / "missing" / "out.v2") + "/", None, None, 0, "auto")
