"""`dmap serve --cache`: the step cache planned and applied as `dmap run --cache` does (one Session, one code path),
so a served image is `dmap run --cache`'s file byte for byte, metadata (`step_cache`) included."""

import base64

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_serve import SEED, SIZE, Server  # noqa: E402  (after the skips: the server needs starlette and uvicorn)

STEPS = 6  # taylorseer's defaults compute the first 3 steps, then one in 5: some of 6 are predicted


@pytest.fixture(scope="module")
def cached_server(tmp_path_factory):
    served = Server(tmp_path_factory, "--cache", "taylorseer", "--queue-size", "2")
    yield served
    served.stop()


def test_a_served_image_with_a_cache_is_dmap_run_caches_file(cached_server, tmp_path):
    from conftest import run_dmap

    from dm_cli.io.outputs import read_metadata

    run = ["run", "-p", "a red fox", "--height", SIZE, "--width", SIZE, "--steps", STEPS, "--seed", SEED, "--mode",
           "staged", "--quiet"]
    code, _, err = run_dmap(*run, "--cache", "taylorseer", "-o", tmp_path / "cached.png")
    assert code == 0, err
    code, _, err = run_dmap(*run, "-o", tmp_path / "full.png")
    assert code == 0, err
    status, data = cached_server.post({"prompt": "a red fox", "seed": SEED, "steps": STEPS, "size": f"{SIZE}x{SIZE}",
                                       "response_format": "b64_json"})
    assert status == 200, data
    served = base64.b64decode(data["data"][0]["b64_json"])
    assert served == (tmp_path / "cached.png").read_bytes()
    assert served != (tmp_path / "full.png").read_bytes()
    assert read_metadata(tmp_path / "cached.png")["step_cache"].startswith("taylorseer")
