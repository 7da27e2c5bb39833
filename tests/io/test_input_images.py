"""Input images (`--image PATH`) read as hostile input: pixels as diffusers' load_image makes them, every bad file
refused in one sentence (exit 2) naming the option and the path, escaped."""

import hashlib
import os
import warnings

import numpy as np
import pytest
from PIL import Image

from dm_cli.errors import EXIT_USAGE, UsageError
from dm_cli.io.input_images import (
    MAX_INPUT_PIXELS,
    describe_image,
    open_input,
    parse_image_size,
    read_image,
)


def as_load_image(path):
    from diffusers.utils import load_image

    return np.array(load_image(str(path)))


def refused(path, match, where="--image"):
    with pytest.raises(UsageError, match=match) as caught:
        read_image(path, where)
    message = str(caught.value)
    assert caught.value.exit_code == EXIT_USAGE and message.count(". ") == 0 and message.endswith(".")
    with pytest.raises(UsageError):  # describe_image refuses what read_image refuses
        describe_image(path, where)
    return message


@pytest.fixture(scope="module")
def rgb():
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P", "CMYK", "I;16", "LA", "L", "1"])
def test_modes_convert_as_load_image_does(tmp_path, rgb, mode):
    pytest.importorskip("diffusers")
    image = Image.fromarray(rgb)
    if mode == "I;16":
        image = Image.fromarray((rgb[..., 0].astype(np.uint16) * 257))
    elif mode == "P":
        image = image.quantize(16)
        image.info["transparency"] = 0
    elif mode != "RGB":
        image = image.convert(mode)
    suffix = ".tiff" if mode in ("CMYK", "I;16") else ".png"
    path = tmp_path / f"in{suffix}"
    image.save(path)
    read = read_image(path)
    assert read.mode == "RGB" and np.array_equal(np.array(read), as_load_image(path))
    described = describe_image(path)
    assert described.size == (40, 24) and described.path == str(path)
    assert described.digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_exif_orientation_is_applied_and_the_size_described_upright(tmp_path, rgb):
    pytest.importorskip("diffusers")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 to view
    path = tmp_path / "rotated.jpg"
    Image.fromarray(rgb).save(path, exif=exif, quality=95)
    assert Image.open(path).size == (40, 24)
    assert read_image(path).size == (24, 40) and describe_image(path).size == (24, 40)
    assert np.array_equal(np.array(read_image(path)), as_load_image(path))


def test_an_animated_file_gives_its_first_frame_as_load_image_does(tmp_path, rgb):
    pytest.importorskip("diffusers")
    frames = [Image.fromarray(rgb), Image.fromarray(255 - rgb)]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(path).n_frames == 2
    assert np.array_equal(np.array(read_image(path)), as_load_image(path))


def test_missing_folder_fifo_and_non_images_are_refused(tmp_path):
    assert "does not exist" in refused(tmp_path / "nope.png", "does not exist")
    refused(tmp_path, r"is a folder, not an image file\.$")
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file")  # never blocks on it
    (tmp_path / "text.png").write_text("not an image at all")
    refused(tmp_path / "text.png", "is not an image dmap reads")
    (tmp_path / "empty.png").write_bytes(b"")
    refused(tmp_path / "empty.png", "is not an image dmap reads")
    link = tmp_path / "dangling.png"
    link.symlink_to(tmp_path / "gone.png")
    refused(link, "not a regular file")


def test_a_format_whose_plugin_runs_a_program_is_refused(tmp_path):
    eps = tmp_path / "x.eps"
    eps.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    refused(eps, "is not an image dmap reads")  # Pillow's EPS plugin would start Ghostscript


def test_a_truncated_file_is_refused_not_padded(tmp_path, rgb):
    path = tmp_path / "full.png"
    Image.fromarray(np.tile(rgb, (8, 8, 1))).save(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.png"
    cut.write_bytes(data[: len(data) // 2])
    Image.open(cut)  # the header reads fine: only a full decode shows it
    refused(cut, "is truncated or damaged")
    jpeg = tmp_path / "full.jpg"
    Image.fromarray(np.tile(rgb, (8, 8, 1))).save(jpeg)
    (tmp_path / "cut.jpg").write_bytes(jpeg.read_bytes()[:600])
    refused(tmp_path / "cut.jpg", "is truncated or damaged")


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path):
    """A PNG declaring 20000x20000 (400 million pixels, a few KB on disk) and one just above dmap's bound (below
    Pillow's error): both refused before a pixel is decoded; Pillow's bomb warning never escapes."""
    side = 20000
    path = tmp_path / "bomb.png"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Image.new("1", (side, side)).save(path)  # bilevel: tiny on disk
    assert path.stat().st_size < 100_000
    refused(path, "than an input image may have")  # Pillow's own bomb error, caught, says it the same way
    above = tmp_path / "above.png"
    Image.new("1", (16384, MAX_INPUT_PIXELS // 16384 + 1)).save(above)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning either
        refused(above, r"at most 16384 a side and 134,217,728 pixels")


def test_paths_are_escaped_in_messages(tmp_path):
    name = tmp_path / "evil\x1b[31mred\n.png"
    name.write_text("nope")
    message = refused(name, "is not an image", where="image")
    assert "\x1b" not in message and "\\x1b[31mred\\n.png" in message and message.startswith("image ")


def test_open_input_refuses_a_file_changed_after_it_was_described(tmp_path, rgb):
    path = tmp_path / "in.png"
    Image.fromarray(rgb).save(path)
    described = describe_image(path)
    assert np.array_equal(np.array(open_input(described)), rgb)
    Image.fromarray(255 - rgb).save(path)
    with pytest.raises(UsageError, match="changed after dmap read it"):
        open_input(described)
    with pytest.raises(UsageError, match="gives only a size"):
        open_input(parse_image_size("40x24"))


def test_parse_image_size():
    assert parse_image_size("1024x768").size == (1024, 768)
    assert parse_image_size(" 640X480 ").size == (640, 480)
    for bad in ("1024", "x768", "1024x", "-1x5", "1.5x2", "", "1024x768x3"):
        with pytest.raises(UsageError, match=r"^--image-size must be WIDTHxHEIGHT"):
            parse_image_size(bad)
    with pytest.raises(UsageError, match="has no pixels"):
        parse_image_size("0x768")
    with pytest.raises(UsageError, match="more than an input image may have"):
        parse_image_size("16385x16")
