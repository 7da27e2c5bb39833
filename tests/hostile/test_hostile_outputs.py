"""Hostile input, round 2, about what `dmap run` writes, written as attacks (issue 18): 8 a huge
--num-images must not hang building and checking the output names, 9 a queue item's output name
the file system refuses is exit 2 when the queue is read, 13 the bytes written are the format the
output's suffix names (or the suffix is refused before anything loads)."""

import json
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image
from test_hostile import _runner_must_not_start, cli

MAGIC = {"png": lambda b: b[:8] == b"\x89PNG\r\n\x1a\n", "jpg": lambda b: b[:3] == b"\xff\xd8\xff",
         "jpeg": lambda b: b[:3] == b"\xff\xd8\xff", "webp": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WEBP"}
METADATA = {"prompt": "a red fox — in the snow ✓", "seed": "7", "steps": "2", "guidance_scale": "3.5",
            "source": "tiny", "pipeline": "FluxPipeline", "height": "32", "width": "32", "plan_digest": "0" * 16,
            "dmap_version": "0"}


def _count_stats(monkeypatch) -> list:
    """Every stat, lstat and scandir the code under test makes (not imports: they use posix directly)."""
    calls = []
    for name in ("stat", "lstat", "scandir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    return calls


# --- 8: a huge --num-images ------------------------------------------------------------------------


def test_8_names_for_many_images_are_made_on_demand_and_collisions_found_with_one_scan(tmp_path, monkeypatch):
    """`--num-images 1000000000` hung: a Path per image, then a stat (and a resolve) per name. The names are
    now made when asked for, and what already exists is found by one scan of the folder, whatever the count."""
    from dm_cli.io.images import existing_image_paths, image_paths

    count = 10**5
    paths = image_paths(tmp_path / "out.png", count)
    assert len(paths) == count and paths[0] == tmp_path / "out-0.png" and paths[-1] == tmp_path / "out-99999.png"
    names = [p.name for p in paths]
    assert len(set(names)) == count and names[12345] == "out-12345.png"
    assert image_paths(tmp_path / "out.png", 1)[:] == [tmp_path / "out.png"]  # one image: the name as given
    assert image_paths(tmp_path / "out", 3)[-1] == tmp_path / "out-2.png"  # several without a suffix: .png
    assert len(image_paths(tmp_path / "out.png", 10**9)) == 10**9  # nothing is built up front

    for taken in ("out-99999.png", "out-0.png", "out-50000.png"):
        (tmp_path / taken).write_bytes(b"mine")
    (tmp_path / "out-7.png").mkdir()
    (tmp_path / "out-8.png").symlink_to(tmp_path / "nowhere")  # a dangling link exists too
    for decoy in ("out-100000.png", "out-007.png", "out-x.png", "out-1.jpg", "out.png", "xout-1.png", "out--1.png"):
        (tmp_path / decoy).write_bytes(b"not an output of this run")
    calls = _count_stats(monkeypatch)
    found = existing_image_paths(tmp_path / "out.png", count)
    assert [p.name for p in found] == ["out-0.png", "out-7.png", "out-8.png", "out-50000.png", "out-99999.png"]
    assert calls.count("scandir") == 1 and len(calls) < 10, calls
    assert existing_image_paths(tmp_path / "out.png", 1) == [tmp_path / "out.png"]
    assert existing_image_paths(tmp_path / "none" / "out.png", count) == []


def test_8_run_with_many_images_checks_its_outputs_without_a_stat_per_name(tmp_path, monkeypatch, capsys):
    (tmp_path / "out-4999.png").write_bytes(b"mine")
    _runner_must_not_start(monkeypatch)
    monkeypatch.chdir(tmp_path)
    calls = _count_stats(monkeypatch)
    code, _, err = cli(capsys, "run", "-p", "x", "-o", tmp_path / "out.png", "--num-images", "5000",
                         "--save-latents", tmp_path / "out-4998.png")
    assert code == 2 and "--save-latents" in err and "also the --output file" in err, err
    assert len(calls) < 100, len(calls)  # was 5 per image
    assert (tmp_path / "out-4999.png").read_bytes() == b"mine"


def test_8_an_existing_output_among_many_is_still_refused(tmp_path, monkeypatch):
    from dm_cli.errors import UsageError
    from dm_cli.io.atomic import refuse_existing
    from dm_cli.io.images import existing_image_paths
    from dm_cli.run.settle.settle import check_run_request

    (tmp_path / "out-4999.png").mkdir()
    with pytest.raises(UsageError, match="out-4999.png is a folder"):
        check_run_request(str(tmp_path / "out.png"), None, 5000, 0, "auto")
    (tmp_path / "out-4999.png").rmdir()
    (tmp_path / "out-4242.png").write_bytes(b"mine")
    check_run_request(str(tmp_path / "out.png"), None, 5000, 0, "auto")  # a file is refused at settle time
    with pytest.raises(UsageError, match="out-4242.png already exists"):
        refuse_existing(existing_image_paths(tmp_path / "out.png", 5000), overwrite=False)


# --- 9: a queue item's output name ----------------------------------------------------------------


@pytest.mark.parametrize("name, words", [
    ("a" * 300 + ".png", "is a file name of 304 bytes"),
    ("é" * 120 + ".png", "is a file name of 244 bytes"),  # 124 characters, 244 bytes: bytes count
    ("x\u0001.png", "control character"),
    ("x\udc80.png", "not UTF-8"),
])
def test_9_queue_output_name_the_file_system_refuses_is_exit_2_when_read(tmp_path, monkeypatch, capsys, name, words):
    """A 300-byte `output` was exit 1 after its image was generated (ENAMETOOLONG when writing)."""
    queue = tmp_path / "q.jsonl"
    queue.write_text(json.dumps({"prompt": "a fox"}) + "\n" + json.dumps({"prompt": "a cat", "output": name}) + "\n",
                     encoding="utf-8")
    _pipeline_must_not_start(monkeypatch)
    code, _, err = cli(capsys, "run", "--prompts", queue, "-o", tmp_path / "renders")
    assert code == 2 and words in err and "line 2" in err and err.count("\n") == 1, err
    assert not (tmp_path / "renders").exists()


def test_9_queue_path_too_long_for_the_system_is_exit_2(tmp_path, monkeypatch, capsys):
    from dm_cli.errors import UsageError
    from dm_cli.run.sessions.queue import read_prompts

    queue = tmp_path / "q.txt"
    queue.write_text("a fox\n", encoding="utf-8")
    deep = tmp_path.joinpath(*["d" * 200] * 21)  # 4200 bytes: a folder path under PATH_MAX is fine, over is not
    with pytest.raises(UsageError, match=r"q.txt, line 1: 'output' .* is a path of \d+ bytes"):
        read_prompts(queue, 0, deep)
    assert read_prompts(queue, 0, tmp_path / ("d" * 200))[0].output == "00000.png"


def _pipeline_must_not_start(monkeypatch):
    import dm_cli.run.sessions.session

    def refuse(*args, **kwargs):
        raise AssertionError("the pipeline started: the bad queue should have been caught before")

    monkeypatch.setattr(dm_cli.run.sessions.session.Session, "__init__", refuse)


# --- 13: the format the suffix names ----------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["png", "jpg", "jpeg", "webp", "JPG"])
def test_13_image_bytes_are_the_format_the_suffix_names_with_readable_metadata(tmp_path, suffix):
    """`-o out.jpg` wrote PNG bytes under a .jpg name."""
    from dm_cli.io.images import read_image_metadata
    from dm_cli.io.outputs import is_complete, save_images

    image = Image.new("RGB", (32, 32), (200, 30, 40))
    written = save_images([image], str(tmp_path / f"out.{suffix}"), METADATA)
    assert written == [str(tmp_path / f"out.{suffix}")]
    data = Path(written[0]).read_bytes()
    assert MAGIC[suffix.lower()](data), data[:16]
    with Image.open(written[0]) as back:
        assert read_image_metadata(back) == METADATA
        assert back.size == (32, 32)
    assert is_complete(Path(written[0]), METADATA) == (True, "complete")  # a queue resumes over any of them
    several = save_images([image, image], str(tmp_path / f"many.{suffix}"), METADATA)
    assert [Path(p).name for p in several] == [f"many-0.{suffix}", f"many-1.{suffix}"]
    assert all(MAGIC[suffix.lower()](Path(p).read_bytes()) for p in several)


def test_13_no_suffix_is_a_png_under_the_name_given(tmp_path):
    from dm_cli.io.outputs import save_images

    image = Image.new("RGB", (8, 8))
    assert save_images([image], str(tmp_path / "out"), METADATA) == [str(tmp_path / "out")]
    assert MAGIC["png"]((tmp_path / "out").read_bytes())
    assert save_images([image, image], str(tmp_path / "many"), METADATA)[1] == str(tmp_path / "many-1.png")


@pytest.mark.parametrize("name", ["out.bmp", "out.txt", "out.tiff", "out.png.exe"])
def test_13_an_unknown_suffix_is_exit_2_before_anything_loads(tmp_path, monkeypatch, capsys, name):
    _runner_must_not_start(monkeypatch)
    code, _, err = cli(capsys, "run", "-p", "x", "-o", tmp_path / name)
    assert code == 2 and ".png, .jpg, .jpeg or .webp" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["out.gif", "out.mp4"])
def test_13_a_video_suffix_for_an_image_pipeline_is_exit_2_before_weights_are_read(tmp_path, monkeypatch, capsys, name):
    """Before the pipeline is known a video suffix may be right; an image pipeline refuses it when the run is
    settled, before any weight file is opened (this folder has none) or torch is imported."""
    from dm_cli.model.sources import PRESETS_DIR

    folder = tmp_path / "pipe"
    shutil.copytree(PRESETS_DIR / "tiny-sd15", folder)
    import dm_cli.model.models

    monkeypatch.setattr(dm_cli.model.models, "quiet_libraries", lambda: (_ for _ in ()).throw(AssertionError("imported")))
    code, _, err = cli(capsys, "run", folder, "-p", "x", "-o", tmp_path / name)
    assert code == 2 and ".png, .jpg, .jpeg or .webp" in err, err
    assert not (tmp_path / name).exists()


def test_13_a_prompt_too_long_for_a_jpeg_comment_is_refused_first(tmp_path, monkeypatch, capsys):
    from dm_cli.io.images import check_metadata_room

    check_metadata_room("out.jpg", "a fox " * 1000, None, "--output")
    check_metadata_room("out.png", "a fox " * 100_000, None, "--output")  # PNG text has no such limit
    queue = tmp_path / "q.jsonl"
    queue.write_text(json.dumps({"prompt": "a fox " * 20_000, "output": "fox.jpg"}) + "\n", encoding="utf-8")
    _pipeline_must_not_start(monkeypatch)
    code, _, err = cli(capsys, "run", "--prompts", queue, "-o", tmp_path / "renders")
    assert code == 2 and "too long for a JPEG" in err and "line 1" in err, err


@pytest.mark.parametrize("output, expected", [
    ("cat.jpg", "cat.jpg"), ("cat.JPEG", "cat.JPEG"), ("cat.webp", "cat.webp"), ("cat", "cat.png"), ("cat.png", "cat.png"),
])
def test_13_queue_output_keeps_an_image_suffix_and_adds_png_to_others(tmp_path, output, expected):
    from dm_cli.run.sessions.queue import read_prompts

    queue = tmp_path / "q.jsonl"
    queue.write_text(json.dumps({"prompt": "a fox", "output": output}) + "\n", encoding="utf-8")
    assert read_prompts(queue)[0].output == expected
    queue.write_text(json.dumps({"prompt": "a fox", "output": output + ".bmp"}) + "\n", encoding="utf-8")
    assert read_prompts(queue)[0].output == output + ".bmp.png"  # any other name is a PNG, .png added as before


def test_13_a_run_writes_the_format_its_output_names(tmp_path, capsys):
    """End to end through `dmap run` (the random-weight demo): a WebP with the run's metadata in it."""
    from dm_cli.io.images import read_image_metadata

    code, _, err = cli(capsys, "run", "-p", "a fox", "--steps", 1, "--height", 64, "--width", 64,
                         "-o", tmp_path / "fox.webp", "-q")
    assert code == 0, err
    assert MAGIC["webp"]((tmp_path / "fox.webp").read_bytes())
    with Image.open(tmp_path / "fox.webp") as image:
        meta = read_image_metadata(image)
    assert meta["prompt"] == "a fox" and meta["steps"] == "1" and meta["height"] == "64"


def test_13_png_bytes_under_a_jpeg_name_do_not_count_as_a_finished_queue_item(tmp_path):
    """What an older dmap wrote for `-o x.jpg`: resuming must redo it as a real JPEG, not skip it."""
    from dm_cli.io.outputs import is_complete, save_images

    save_images([Image.new("RGB", (32, 32))], str(tmp_path / "x.png"), METADATA)
    (tmp_path / "x.png").rename(tmp_path / "x.jpg")
    assert is_complete(tmp_path / "x.jpg", METADATA) == (False, "made in another format")


def test_13_stale_temporaries_of_a_name_with_glob_characters_are_removed(tmp_path):
    from dm_cli.run.sessions.queue import QueueItem, remove_stale_temporaries

    (tmp_path / ".a[1].png.abcd1234.tmp").write_bytes(b"")
    (tmp_path / ".a1.png.abcd1234.tmp").write_bytes(b"someone else's")
    remove_stale_temporaries(tmp_path, QueueItem(0, "a fox", 0, "a[1].png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a1.png.abcd1234.tmp"]
