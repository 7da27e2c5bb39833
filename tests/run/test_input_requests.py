"""Input images in a request: `--image` / `--image-size` for plan and run, queue JSONL "image", the API's
`image=` (paths or PIL images), their digests in the metadata and the resume key. The families that read
them are tested in their own files; this is the plumbing every one of them shares."""

from __future__ import annotations

import json

import pytest
from conftest import run_dmap

from dm_cli.errors import UsageError
from dm_cli.inputs import Generation, InputSpec

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


@pytest.fixture()
def picture(tmp_path):
    path = tmp_path / "fox.png"
    Image.new("RGB", (40, 24), (200, 80, 20)).save(path)
    return path


def test_a_text_to_image_family_refuses_input_images_in_plan_and_run(tmp_path, picture):
    code, _, err = run_dmap("plan", "flux", "--image-size", "1024x1024", "-q")
    assert code == 2 and "take no input image: drop --image" in err, err
    code, _, err = run_dmap("run", "--prompt", "a fox", "--image", str(picture), "-o", str(tmp_path / "x.png"))
    assert code == 2 and "take no input image: drop --image" in err, err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("text", ["1024", "0x5", "axb", "99999999x2"])
def test_a_bad_image_size_is_one_sentence(text):
    code, _, err = run_dmap("plan", "flux", "--image-size", text, "-q")
    assert code == 2 and "--image-size" in err and "Traceback" not in err, err


def test_plan_files_keep_image_sizes_and_text_plans_stay_as_they_were():
    spec = InputSpec(64, 64, image_sizes=((40, 24), (16, 16)))
    data = spec.to_json()
    assert data["image_sizes"] == [[40, 24], [16, 16]] and InputSpec.from_json(data) == spec
    assert "image_sizes" not in InputSpec(64, 64).to_json()
    with pytest.raises(UsageError, match="image_sizes"):
        InputSpec.from_json({**data, "image_sizes": [[1, 2, 3]]})
    with pytest.raises(UsageError, match="no pixels|whole number"):
        InputSpec.from_json({**data, "image_sizes": [[0, 24]]})


def test_request_reads_paths_and_pil_images_in_order(picture):
    from dm_cli.run.request import RunRequest, input_images

    request = RunRequest.of(None, "a fox", images=[str(picture), Image.new("RGBA", (8, 4))])
    first, second = request.generation.images
    assert (first.width, first.height, first.path) == (40, 24, str(picture)) and len(first.digest) == 64
    assert second.path is None and second.pixels.mode == "RGB" and second.size == (8, 4)
    assert request.generation.inputs().image_sizes == ((40, 24), (8, 4))
    assert input_images(None) == () and input_images(str(picture)) == (first,)
    with pytest.raises(UsageError, match="image paths or PIL images"):
        input_images([3])


def test_queue_items_take_an_image_or_a_list(tmp_path, picture):
    from dm_cli.run.sessions.queue import read_prompts

    lines = [{"prompt": "a", "image": str(picture)}, {"prompt": "b", "image": [str(picture), str(picture)]},
             {"prompt": "c"}]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    a, b, c = read_prompts(tmp_path / "q.jsonl")
    assert len(a.images) == 1 and len(b.images) == 2 and c.images == ()
    assert a.to_json()["images"] == [{"width": 40, "height": 24, "path": str(picture), "digest": a.images[0].digest}]
    for bad in ({"prompt": "a", "image": 3}, {"prompt": "a", "image": []}, {"prompt": "a", "image": [""]}):
        (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(UsageError, match="'image' must be a path or a list of paths"):
            read_prompts(tmp_path / "bad.jsonl")


def test_an_input_image_s_digest_is_metadata_and_part_of_the_resume_key(tmp_path, picture):
    from dm_cli.families import Job
    from dm_cli.io.outputs import is_complete, save_images
    from dm_cli.run.request import input_images
    from dm_cli.run.sessions.outputs import job_metadata
    from dm_cli.run.sessions.queue import resume_keys

    (image,) = input_images(str(picture))
    job = Job.of(Generation(steps=2, guidance_scale=1.0, height=24, width=40, images=(image,)), "a fox", 0)
    meta = job_metadata(job, "src", "FluxKontextPipeline", "d", False)
    assert meta["input_images"] == f"40x24:{image.digest}"
    assert "input_images" not in job_metadata(Job.of(Generation(steps=2, guidance_scale=1.0, height=24, width=40),
                                                     "a fox", 0), "src", "FluxPipeline", "d", False)
    out = tmp_path / "out.png"
    save_images([Image.new("RGB", (40, 24))], str(out), meta)
    assert is_complete(out, meta, resume_keys())[0]
    Image.new("RGB", (40, 24), (1, 2, 3)).save(picture)  # the input changed: the output is not this job's
    (changed,) = input_images(str(picture))
    other = job_metadata(Job.of(Generation(steps=2, guidance_scale=1.0, height=24, width=40, images=(changed,)),
                                "a fox", 0), "src", "FluxKontextPipeline", "d", False)
    done, why = is_complete(out, other, resume_keys())
    assert not done and "input images" in why, why


def test_a_queue_with_images_gives_the_same_images_in_one_process_and_on_two_torchrun_ranks(tmp_path_factory):
    """Two JSONL items, each with its own input image (tiny FLUX.1 img2img, random weights): the images one process
    writes, and the ones two CPU ranks under torchrun write (item i on rank i % 2), are the same pixels."""
    import os
    import subprocess
    import sys

    import numpy as np
    import torch
    from conftest import REPO

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("queue-images")
    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux-img2img", root / "img2img", seed=0)
    for name, colour in (("red.png", (200, 40, 20)), ("blue.png", (20, 60, 220))):
        Image.new("RGB", (32, 32), colour).save(root / name)
    items = [{"prompt": "a fox", "image": str(root / "red.png")}, {"prompt": "a fox", "image": str(root / "blue.png")}]
    (root / "q.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    args = ["--prompts", str(root / "q.jsonl"), "--height", "32", "--width", "32", "--steps", "2", "-q"]
    code, _, err = run_dmap("run", str(folder), *args, "--output", str(root / "one"))
    assert code == 0, err
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": str(REPO)}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dm_cli",
              "run", str(folder), *args, "--output", str(root / "two")]
    done = subprocess.run(launch, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    one, two = sorted((root / "one").glob("*.png")), sorted((root / "two").glob("*.png"))
    assert [p.name for p in one] == [p.name for p in two] and len(one) == 2
    pixels = [[np.array(Image.open(p)) for p in side] for side in (one, two)]
    assert all(np.array_equal(a, b) for a, b in zip(*pixels))
    assert not np.array_equal(*pixels[0])  # the two items' own images made two different pictures
    ranks = [json.loads(line)["rank"] for line in (root / "two" / "manifest.jsonl").read_text().splitlines()]
    assert ranks == [0, 1]
