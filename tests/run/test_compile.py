"""--compile (issue 55): one option on run, serve, the queue and the API, settled once (compile or eager with one notice,
or refused in one sentence), applied by the `compile` loop hook as the denoiser loads, its cold seconds apart from the
steps'. Most tests trace with dynamo's `eager` backend (DMAP_COMPILE_BACKEND: no C++ build, seconds); the slow one
compiles with inductor and compares the pixels with eager's."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import PRESETS, run_dmap

SIZE, STEPS = 32, 2
EAGER_BACKEND = {"DMAP_COMPILE_BACKEND": "eager"}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    return write_random_pipeline(PRESETS / "tiny-flux", tmp_path_factory.mktemp("compile") / "tiny-flux", seed=0)


def _pixels(path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path)).astype(int)


# --- the option, the same on every path ---------------------------------------------------------------------


def test_a_bad_compile_is_one_sentence_exit_2_on_the_cli_and_the_api():
    code, _, err = run_dmap("run", "--prompt", "x", "--compile", "fast")
    assert code == 2 and "--compile must be" in err and "Traceback" not in err, err
    import dm_cli
    from dm_cli.errors import UsageError

    with pytest.raises(UsageError, match=r"--compile must be one of none, regional, auto, full, not 'fast'"):
        dm_cli.load(None, compile="fast")


def test_cli_api_and_queue_settle_the_same_compile():
    """The CLI's fields, the API's keyword and the queue's run request all become RunRequest.compile alike."""
    from dm_cli.run.hooks.compile import CompileMode, parse_compile
    from dm_cli.run.options import option, queue_keys
    from dm_cli.run.request import RunRequest

    assert "compile" not in queue_keys() and option("compile").default == "none"
    for asked, settled in (("regional", "regional"), ("AUTO", "auto"), ("full", "full"), (None, "none")):
        request = RunRequest.of(None, "x", compile=asked)
        assert request.compile == settled == parse_compile(asked).value
    assert RunRequest.of(None, "x").compile == "none" and parse_compile(True) is CompileMode.AUTO


def _fake(simulate=False, track=False, loras=(), weights=None, device_map=None, cache=None, fused=()):
    request = SimpleNamespace(simulate=simulate, track_activations=track,
                              generation=SimpleNamespace(loras=tuple(SimpleNamespace(component=c) for c in loras)))
    plan = SimpleNamespace(components={"transformer": SimpleNamespace(device_map=device_map or {"": "cpu"})},
                           weights=weights or {}, cache=cache,
                           loras=[{"component": c, "fused": True} for c in fused])
    family = SimpleNamespace(denoiser="transformer", experts=())
    return request, plan, family


@pytest.mark.parametrize("kind,reason", [
    ({"simulate": True}, "activation tracker"),
    ({"track": True}, "activation tracker"),
    ({"loras": ("transformer",)}, "LoRAs of transformer stay unfused"),
    ({"weights": {"transformer": "nf4"}}, "transformer's nf4 weights are dequantized by bitsandbytes"),
    ({"weights": {"transformer": "fp8"}}, "transformer's fp8 weights are cast up by diffusers' layerwise-casting"),
    ({"device_map": {"a": 0, "b": "cpu"}}, "streams blocks from cpu or disk"),
    ({"device_map": {"a": "cpu", "b": "disk"}}, "streams blocks from cpu or disk"),
    ({"cache": SimpleNamespace(name="fbc")}, "step cache fbc"),
])
def test_what_cannot_compile_runs_eager_with_one_notice(kind, reason):
    from dm_cli.run.hooks.compile import compile_choice

    mode, notice = compile_choice("regional", *_fake(**kind), None)
    assert mode == "none" and notice.startswith("--compile regional: running eager, ") and reason in notice, notice
    assert notice.count(".") >= 1 and "\n" not in notice


def test_fused_loras_fp8_and_a_gpu_split_compile():
    from dm_cli.run.hooks.compile import compile_choice

    for kind in ({"loras": ("transformer",), "fused": ("transformer",)}, {"weights": {"transformer": "int8"}},
                 {"device_map": {"a": 0, "b": 1}}, {}):
        assert compile_choice("auto", *_fake(**kind), None) == ("auto", None), kind
    assert compile_choice("none", *_fake(simulate=True), None) == ("none", None)


def test_ranks_sharing_a_step_are_refused_in_one_sentence():
    from dm_cli.errors import UsageError
    from dm_cli.run.hooks.compile import compile_choice

    for layout in ("cfg", "context", "pipeline"):
        with pytest.raises(UsageError, match=rf"--compile runs in one process: --parallel {layout} ranks .* drop "
                                             r"--compile or --parallel\.$"):
            compile_choice("regional", *_fake(), SimpleNamespace(layout=layout))


def test_serve_says_compiled_or_eager():
    from dm_cli.planning.modes import CompileMode
    from dm_cli.serve.server import compiled_words

    assert compiled_words(SimpleNamespace(settled=SimpleNamespace(compile=CompileMode.NONE))) == "eager (no compile)"
    assert compiled_words(SimpleNamespace(settled=SimpleNamespace(compile=CompileMode.REGIONAL))) == \
        "compiled (regional, at the warm-up)"


# --- runs (dynamo's eager backend: the wiring, in seconds) --------------------------------------------------------


def test_run_compiles_the_denoiser_regionally_and_shows_its_seconds(flux, tmp_path):
    out = tmp_path / "c.png"
    code, stdout, err = run_dmap("run", flux, "--prompt", "a cat", "--height", SIZE, "--width", SIZE, "--steps", STEPS,
                                 "--compile", "regional", "-o", out, "--json", env=EAGER_BACKEND)
    assert code == 0, err
    result = json.loads(stdout)
    denoise = next(s for s in result["stages"] if s["name"] == "denoise")
    assert denoise["compile_s"] > 0 and all(s["compile_s"] == 0 for s in result["stages"] if s is not denoise)
    assert not result["notices"] or all("--compile" not in n for n in result["notices"])
    eager = tmp_path / "e.png"
    code, _, err = run_dmap("run", flux, "--prompt", "a cat", "--height", SIZE, "--width", SIZE, "--steps", STEPS,
                            "-o", eager, "--quiet")
    assert code == 0, err
    assert abs(_pixels(out) - _pixels(eager)).max() <= 1  # dynamo's eager backend: the same ops


def test_the_table_shows_compile_seconds_apart(flux, tmp_path):
    code, stdout, err = run_dmap("run", flux, "--prompt", "a cat", "--height", SIZE, "--width", SIZE, "--steps", STEPS,
                                 "--compile", "full", "-o", tmp_path / "c.png", env={**EAGER_BACKEND, "COLUMNS": "160"})
    assert code == 0, err
    assert "compile s" in stdout and "torch.compile's cold start" in stdout, stdout


def test_simulate_with_compile_runs_eager_with_one_notice(flux, tmp_path):
    code, stdout, err = run_dmap("run", flux, "--prompt", "a cat", "--height", SIZE, "--width", SIZE, "--steps", STEPS,
                                 "--max-memory", "0=10GB,1=10GB", "--simulate", "--compile", "regional",
                                 "-o", tmp_path / "s.png", "--json", env=EAGER_BACKEND)
    assert code == 0, err
    result = json.loads(stdout)
    notices = [n for n in result["notices"] if n.startswith("--compile")]
    assert len(notices) == 1 and "running eager" in notices[0], result["notices"]
    assert all(s["compile_s"] == 0 for s in result["stages"])


def test_int8_weights_compile_and_fp8_runs_eager_with_its_notice(flux, tmp_path):
    for weights, compiled in (("int8", True), ("fp8", False)):
        code, stdout, err = run_dmap("run", flux, "--prompt", "a cat", "--height", SIZE, "--width", SIZE, "--steps",
                                     STEPS, "--weights", weights, "--compile", "regional", "-o", tmp_path / f"{weights}.png",
                                     "--json", env=EAGER_BACKEND)
        assert code == 0, err
        result = json.loads(stdout)
        notices = [n for n in result["notices"] if n.startswith("--compile")]
        assert (sum(s["compile_s"] for s in result["stages"]) > 0) is compiled and len(notices) == (not compiled), notices


def test_the_api_and_a_queue_compile_as_the_cli_does(flux, tmp_path, monkeypatch):
    import dm_cli

    monkeypatch.setenv("DMAP_COMPILE_BACKEND", "eager")

    with dm_cli.load(str(flux), height=SIZE, width=SIZE, compile="auto") as session:
        assert session.settled.compile == "auto"
        images = list(session.generate(["a cat"], seed=0, steps=STEPS))
        assert session._loop.hooks["compile"].compiled == {"transformer": "regional"} and images[0].image
    prompts = tmp_path / "q.txt"
    prompts.write_text("a cat\na dog\n")
    code, _, err = run_dmap("run", flux, "--prompts", prompts, "--height", SIZE, "--width", SIZE, "--steps", STEPS,
                            "--compile", "regional", "-o", tmp_path / "q", "--quiet", env=EAGER_BACKEND)
    assert code == 0 and len(list(Path(tmp_path / "q").glob("*.png"))) == 2, err


@pytest.mark.slow
def test_inductor_images_are_within_one_level_of_eager(flux, tmp_path, monkeypatch):
    """inductor's C++ kernels (gcc) on this CPU: the pixels of a regional compile within 1 of 255 of eager's."""
    monkeypatch.delenv("DMAP_COMPILE_BACKEND", raising=False)
    paths = {}
    for mode in ("none", "regional"):
        paths[mode] = tmp_path / f"{mode}.png"
        code, _, err = run_dmap("run", flux, "--prompt", "a cat", "--height", SIZE, "--width", SIZE, "--steps", STEPS,
                                "--compile", mode, "-o", paths[mode], "--quiet")
        assert code == 0, err
    assert abs(_pixels(paths["regional"]) - _pixels(paths["none"])).max() <= 1


def test_serve_compiles_at_its_warm_up_and_serves_a_staged_reload(flux, tmp_path):
    """`dmap serve --compile`: the warm-up image compiles (said on stderr, before the start-up line), and a request
    after it (staged: the denoiser loaded again, compiled again) is answered."""
    import base64
    import http.client
    import os
    from urllib.parse import urlsplit

    pytest.importorskip("uvicorn")
    from serve_process import start_serve, stop_serve

    env = {**os.environ, **EAGER_BACKEND, "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the server writes it until stopped
    proc, url = start_serve([flux, "--height", SIZE, "--width", SIZE, "--steps", STEPS, "--mode", "staged", "--port",
                             "0", "--compile", "regional"], cwd=tmp_path, env=env, stderr=log)
    try:
        connection = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=120)
        connection.request("POST", "/v1/images/generations", body=json.dumps(
            {"prompt": "a red fox", "seed": 3, "response_format": "b64_json"}), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        data = json.loads(response.read())
        assert response.status == 200 and base64.b64decode(data["data"][0]["b64_json"]).startswith(b"\x89PNG"), data
    finally:
        assert stop_serve(proc) == 0
        log.close()
    said = (tmp_path / "serve.log").read_text()
    assert "and compiling the denoiser" in said and "running eager" not in said, said
