"""Step caches (`--cache`, issue 33): parsing, refusals, the plan's count, and the same cache on every path (plan vs
run inline vs `run -d PLAN.json`, CLI vs API vs a queue item)."""

from __future__ import annotations

import json

import pytest
from conftest import PRESETS, run_dmap

DEVICES = ["--max-memory", "0=10GB,cpu=10GB", "--simulate"]


@pytest.mark.parametrize("spec,message", [
    ("foo", "Unknown step cache 'foo'"),
    ("fbc:threshold=abc", "threshold must be a number above 0 and at most 1, not 'abc'"),
    ("fbc:thresh=0.1", "has no setting 'thresh'"),
    ("fbc:threshold=2", "at most 1"),
    ("fbc:threshold", "needs a value"),
    ("taylorseer:cache_interval=0", "from 1 to 1000"),
    ("taylorseer:lite=maybe", "lite must be true, false or auto, not 'maybe'"),
    ("fbc:threshold=0.1,threshold=0.2", "twice"),
    ("fastercache", "FasterCache needs a timestep callback"),
    ("pyramid_attention_broadcast", "Pyramid Attention Broadcast needs a timestep callback"),
])
def test_bad_cache_is_one_sentence_exit_2(spec, message):
    code, out, err = run_dmap("plan", "tiny-flux", "--max-memory", "0=10GB", "--cache", spec)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_a_cache_the_family_does_not_take_is_refused():
    code, _, err = run_dmap("plan", "tiny-qwenimage", "--max-memory", "0=10GB", "--cache", "magcache")
    assert code == 2 and "take --cache fbc or taylorseer, not magcache" in err, err
    code, _, err = run_dmap("plan", "tiny-sdxl", "--max-memory", "0=10GB", "--cache", "fbc")
    assert code == 2 and "take no --cache" in err, err


def test_parse_fills_defaults_and_labels():
    from dm_cli.planning.step_cache import parse_cache

    assert parse_cache(None) is None and parse_cache("none") is None
    cache = parse_cache("taylorseer:max_order=2,lite=true")
    assert cache.label == "taylorseer:cache_interval=5,disable_cache_before_step=3,lite=true,max_order=2"
    assert parse_cache(cache.label) == cache == parse_cache({"name": "taylorseer", "max_order": 2, "lite": True})


def test_taylorseer_lite_is_the_familys_unless_the_user_sets_it():
    """lite=auto (the default, issue 40): lite on FLUX and Qwen-Image, whose MLPs full mode still runs, full mode
    (attentions predicted, Wan's own patterns) on Wan; a user's true or false wins on every family."""
    pytest.importorskip("diffusers")
    from dm_cli.families.flux import FluxFamily
    from dm_cli.families.qwenimage import QwenImageFamily
    from dm_cli.families.wan import WanFamily
    from dm_cli.planning.step_cache import diffusers_config, parse_cache

    default = parse_cache("taylorseer")
    assert default.setting("lite") == "auto" and "lite=auto" in default.label and parse_cache(default.label) == default
    for family, lite in ((FluxFamily(), True), (QwenImageFamily(), True), (WanFamily(), False)):
        config = diffusers_config(default, family, 16)
        assert config.use_lite_mode is lite, family
        assert bool(config.cache_identifiers) is (isinstance(family, WanFamily) and not lite)
    for family in (FluxFamily(), QwenImageFamily(), WanFamily()):
        assert diffusers_config(parse_cache("taylorseer:lite=false"), family, 16).use_lite_mode is False
        assert diffusers_config(parse_cache("taylorseer:lite=true"), family, 16).use_lite_mode is True
    assert diffusers_config(parse_cache("taylorseer:lite=false"), WanFamily(), 16).cache_identifiers


def test_taylorseer_default_plans_the_lite_hooks_on_flux():
    """The default reaches the hooks the plan counts: on tiny FLUX the state of lite (proj_out's terms), not of full
    mode (every attention's)."""
    pytest.importorskip("torch")
    from dm_cli import plan

    held = {spec: plan("tiny-flux", max_memory="0=10GB,cpu=10GB", cache=spec).step_cache["components"]["transformer"]
            for spec in ("taylorseer", "taylorseer:lite=true", "taylorseer:lite=false")}
    assert held["taylorseer"]["holders"] == held["taylorseer:lite=true"]["holders"] == {"proj_out": held[
        "taylorseer"]["total_bytes"]}
    assert len(held["taylorseer:lite=false"]["holders"]) > 1


@pytest.mark.parametrize("name", ["fbc", "taylorseer", "magcache"])
def test_plan_counts_the_cache_on_the_denoise_device(name, tmp_path):
    pytest.importorskip("torch")
    code, out, err = run_dmap("plan", "tiny-flux", "--max-memory", "0=10GB,cpu=10GB", "--cache", name, "--json")
    assert code == 0, err
    plan = json.loads(out)
    cached = plan["step_cache"]["components"]["transformer"]
    assert plan["step_cache"]["name"] == name and cached["total_bytes"] > 0
    assert sum(cached["holders"].values()) == cached["total_bytes"] == sum(cached["bytes"].values())
    denoise = next(s for s in plan["stages"] if s["name"] == "denoise")
    assert denoise["breakdown"]["0"]["cache"] == cached["bytes"]["0"]
    assert denoise["peak_bytes"]["0"] == sum(denoise["breakdown"]["0"].values())
    # without the cache the same plan has no cache bytes, and the old plan layout is kept
    code, out, _ = run_dmap("plan", "tiny-flux", "--max-memory", "0=10GB,cpu=10GB", "--json")
    bare = json.loads(out)
    assert "step_cache" not in bare
    assert "cache" not in next(s for s in bare["stages"] if s["name"] == "denoise")["breakdown"]["0"]
    # a plan file with a cache loads back as written
    from dm_cli.planning.plan_file import Plan

    assert Plan.from_json(plan).to_json() == plan


def test_taylorseer_holds_more_per_guidance_branch():
    pytest.importorskip("torch")
    from dm_cli import plan

    one = plan("tiny-wan", max_memory="0=10GB,cpu=10GB", cache="taylorseer", guidance_scale=1.0)
    two = plan("tiny-wan", max_memory="0=10GB,cpu=10GB", cache="taylorseer", guidance_scale=5.0)
    first, second = (p.step_cache["components"]["transformer"] for p in (one, two))
    assert (first["contexts"], second["contexts"]) == (1, 2)
    assert second["total_bytes"] == 2 * first["total_bytes"]


def test_cache_bytes_go_to_the_blocks_devices():
    from dm_cli.planning.step_cache import Footprint, placed_bytes

    fbc = Footprint({"transformer_blocks.0": 300, "single_transformer_blocks.7": 200})
    split = {"x_embedder": 0, "transformer_blocks": 0, "single_transformer_blocks": 1, "proj_out": 1}
    assert placed_bytes(fbc, split, 0) == {"0": 300, "1": 200}
    # offloaded blocks keep their state on the execution device (accelerate streams the weights there)
    offloaded = {"transformer_blocks": 0, "single_transformer_blocks": "cpu"}
    assert placed_bytes(fbc, offloaded, 0) == {"0": 500}


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    return write_random_pipeline(PRESETS / "tiny-flux", tmp_path_factory.mktemp("cache") / "tiny-flux", seed=0)


@pytest.mark.slow
def test_inline_plan_and_plan_file_agree_and_metadata_says_the_cache(tiny_flux, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import dm_cli.run.settle.checks as checks_module
    from dm_cli.io.outputs import read_metadata

    planned = []
    real = checks_module.make_run_plan
    monkeypatch.setattr(checks_module, "make_run_plan", lambda *a, **k: planned.append(real(*a, **k)) or planned[-1])
    run = ["run", tiny_flux, "--prompt", "a fox", "--steps", "6", "--seed", "3", "--quiet", "--height", "64",
           "--width", "64"]
    code, _, err = run_dmap(*run, *DEVICES, "--cache", "fbc:threshold=0.2", "--output", tmp_path / "inline.png")
    assert code == 0, err
    code, _, err = run_dmap("plan", tiny_flux, *DEVICES[:2], "--height", "64", "--width", "64", "--steps", "6",
                            "--cache", "fbc:threshold=0.2", "--output", tmp_path / "plan.json", "--quiet")
    assert code == 0, err
    code, _, err = run_dmap(*run, "--device-map", tmp_path / "plan.json", "--simulate", "--output",
                            tmp_path / "filed.png")
    assert code == 0, err
    assert len(planned) == 1 and planned[0].to_json() == json.loads((tmp_path / "plan.json").read_text())
    inline, filed = read_metadata(tmp_path / "inline.png"), read_metadata(tmp_path / "filed.png")
    assert inline == filed and inline["step_cache"] == "fbc:threshold=0.2"
    assert (tmp_path / "inline.png").read_bytes() == (tmp_path / "filed.png").read_bytes()
    # a plan made for a cache refuses another one
    code, _, err = run_dmap(*run, "--device-map", tmp_path / "plan.json", "--simulate", "--cache", "taylorseer",
                            "--output", tmp_path / "other.png")
    assert code == 2 and "was made for --cache fbc:threshold=0.2" in err, err


@pytest.mark.slow
def test_cli_api_and_queue_item_make_the_same_cached_image(tiny_flux, tmp_path):
    pytest.importorskip("torch")
    import numpy as np

    from dm_cli import load
    from dm_cli.io.outputs import read_metadata

    code, _, err = run_dmap("run", tiny_flux, "--prompt", "a fox", "--steps", "6", "--seed", "3", "--quiet",
                            "--height", "64", "--width", "64", "--max-memory", "cpu=10GB", "--cache", "taylorseer",
                            "--output", tmp_path / "cli.png")
    assert code == 0, err
    session = load(str(tiny_flux), max_memory="cpu=10GB", height=64, width=64, cache="taylorseer")
    generated = list(session.generate(["a fox"], seed=3, steps=6))
    queue = tmp_path / "q.jsonl"
    queue.write_text(json.dumps({"prompt": "a fox", "seed": 3, "steps": 6, "cache": "taylorseer"}) + "\n")
    code, _, err = run_dmap("run", tiny_flux, "--prompts", queue, "--quiet", "--height", "64", "--width", "64",
                            "--max-memory", "cpu=10GB", "--cache", "taylorseer", "--output", tmp_path / "q")
    assert code == 0, err
    from PIL import Image

    cli = np.asarray(Image.open(tmp_path / "cli.png").convert("RGB"))
    api = np.asarray(generated[0].images[0].convert("RGB"))
    queued = next((tmp_path / "q").glob("*.png"))
    assert (cli == api).all() and (cli == np.asarray(Image.open(queued).convert("RGB"))).all()
    assert read_metadata(tmp_path / "cli.png")["step_cache"] == read_metadata(queued)["step_cache"]
    # an item asking for another cache than the run's is refused, one sentence
    queue.write_text(json.dumps({"prompt": "a fox", "seed": 3, "cache": "fbc"}) + "\n")
    code, _, err = run_dmap("run", tiny_flux, "--prompts", queue, "--quiet", "--height", "64", "--width", "64",
                            "--max-memory", "cpu=10GB", "--cache", "taylorseer", "--output", tmp_path / "q2")
    assert code == 2 and "cache" in err and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["taylorseer", "fbc", "magcache"])
def test_a_split_denoiser_runs_each_cache_with_the_whole_models_pixels(tiny_flux, tmp_path, name):
    """A real split: the plan cuts tiny FLUX's transformer over two (simulated) GPUs and counts the cache's state on
    the GPU of the block that holds it; the split check with the hooks on finds nothing (fbc's and magcache's first
    and last blocks each take the other's tensors onto their own device); the run with the hooks on gives the
    unsplit cached image, pixel for pixel, and skips the same calls."""
    pytest.importorskip("torch")
    import numpy as np
    from PIL import Image

    from dm_cli.io.outputs import read_metadata

    split = ["--max-memory", "0=800KB,1=800KB", "--overhead", "0=0,1=0", "--height", "32", "--width", "32",
             "--max-sequence-length", "8"]
    # taylorseer in full mode: its state on every block (lite, FLUX's default, keeps less), which this cut is sized for
    settings = {"taylorseer": "taylorseer:lite=false", "fbc": "fbc:threshold=0.3", "magcache": "magcache:threshold=0.5"}[name]
    code, _, err = run_dmap("plan", tiny_flux, *split, "--cache", settings, "--output", tmp_path / "split.json",
                            "--quiet")
    assert code == 0, err
    plan = json.loads((tmp_path / "split.json").read_text())
    device_map = plan["components"]["transformer"]["device_map"]
    assert {device_map["transformer_blocks.0"], device_map["single_transformer_blocks.0"]} == {0, 1}, device_map
    held = plan["step_cache"]["components"]["transformer"]
    assert set(held["bytes"]) == {"0", "1"} and sum(held["bytes"].values()) == held["total_bytes"] > 0
    assert plan["check"]["ran"] and not plan["check"]["problems"], plan["check"]
    run = ["run", tiny_flux, "--prompt", "a fox", "--steps", "8", "--seed", "3", "--quiet", "--json"]
    code, out, err = run_dmap(*run, "--device-map", tmp_path / "split.json", "--simulate", "--output",
                              tmp_path / "split.png")
    assert code == 0, err
    split_counts = json.loads(out)["step_cache"]["counts"]["transformer"]
    code, out, err = run_dmap(*run, "--max-memory", "cpu=10GB", "--height", "32", "--width", "32",
                              "--max-sequence-length", "8", "--cache", settings, "--output", tmp_path / "whole.png")
    assert code == 0, err
    whole_counts = json.loads(out)["step_cache"]["counts"]["transformer"]
    assert split_counts == whole_counts and whole_counts["skipped"] > 0, (split_counts, whole_counts)
    pixels = [np.asarray(Image.open(tmp_path / f).convert("RGB")) for f in ("split.png", "whole.png")]
    assert (pixels[0] == pixels[1]).all()  # the files' metadata differ: each names its own plan
    assert read_metadata(tmp_path / "split.png")["step_cache"] == read_metadata(tmp_path / "whole.png")["step_cache"]


def test_a_pipeline_plan_counts_each_slices_cache_on_its_rank(tiny_flux):
    """--parallel pipeline with fbc: rank 0 holds the first block's residual, rank 1 the last block's residuals and
    the first block's output, which travels to it with the activations; each rank's peak in the layout has its part."""
    pytest.importorskip("torch")
    from dm_cli import plan

    common = {"max_memory": "0=1GB,1=1GB", "world_size": 2, "parallel": "pipeline", "height": 64, "width": 64}
    bare, cached = plan(tiny_flux, **common), plan(tiny_flux, cache="fbc", **common)
    held = cached.step_cache["components"]["transformer"]
    assert cached.parallel.layout == "pipeline" and set(held["ranks"]) == {"0", "1"}
    assert held["ranks"] == held["bytes"] and sum(held["ranks"].values()) == held["total_bytes"]
    hidden = held["ranks"]["0"]  # the first block's residual: the image tokens' hidden states
    assert hidden > 0 and held["ranks"]["1"] > 2 * hidden  # output and residuals of both streams
    assert {rank: cached.parallel.per_rank_peak_bytes[rank] - bare.parallel.per_rank_peak_bytes[rank]
            for rank in ("0", "1")} == held["ranks"]


@pytest.mark.parametrize("before,interval,after", [(3, 2, None), (1, 3, 7), (2, 4, None)])
def test_a_lite_taylorseers_next_call_is_read_as_diffusers_decides_it(before, interval, after):
    """`predicts_next_call` (a pipeline rank's lite TaylorSeer sends no activations on a predicted call) gives, before
    each call, what the hooks then do: every block inactive (zeros) on a predicted call, computed otherwise."""
    import torch
    from diffusers.hooks import TaylorSeerCacheConfig, apply_taylorseer_cache
    from diffusers.hooks.hooks import CacheContext

    from dm_cli.run.hooks.step_cache import lite_block_hook, predicts_next_call

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer_blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
            self.proj_out = torch.nn.Linear(4, 4)

        def forward(self, x):
            for block in self.transformer_blocks:
                x = block(x)
            return self.proj_out(x)

    model = Toy()
    apply_taylorseer_cache(model, TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=before,
                                                        disable_cache_after_step=after, use_lite_mode=True))
    hooks = [m._diffusers_hook.hooks["taylorseer_cache"] for m in model.modules() if hasattr(m, "_diffusers_hook")]
    for hook in hooks:
        hook.state_manager.set_context(CacheContext("cond"))
    hook = lite_block_hook(model)
    assert hook is not None and hook.state_manager._init_kwargs["is_inactive"]
    said, done = [], []
    block = model.transformer_blocks[0]
    with torch.no_grad():
        for _ in range(10):
            said.append(predicts_next_call(hook))
            ran = []
            handle = block.register_forward_hook(lambda module, args, out, ran=ran: ran.append(bool(out.abs().sum() == 0)))
            model(torch.ones(1, 4))
            handle.remove()
            done.append(ran[0])
    assert said == done and any(said) and not all(said), (said, done)
