"""Step time predicted before loading (issue 42): `dmap calibrate`, device profiles, the cost model and its lines in
`dmap plan`."""

import json
import tempfile
from pathlib import Path

import pytest
from conftest import run_dmap

from dm_cli.planning.time.profiles import GPU_TABLE, DeviceProfile, table_profile
from dm_cli.planning.time.step_time import CallWork, Traffic, call_terms, predict


def hand_profile(**changes) -> DeviceProfile:
    """Round rates, so that every term of the hand-made case below is a whole number of seconds."""
    base = {"name": "hand", "kind": "cpu", "matmul_tflops": {"bfloat16": 1.0}, "attention_tflops": {"bfloat16": 0.5},
                "memory_gbps": 2.0, "host_gbps": 4.0, "link_gbps": 2.0, "op_seconds": 1e-3, "elementwise_gbps": 1.0}
    return DeviceProfile(**{**base, **changes})


def test_cost_model_adds_each_term_of_a_hand_made_case():
    work = CallWork(matmul_flops=2e12, attention_flops=1e12, other_bytes=1e9, ops=1000, weight_bytes=2 * 10**9,
                    matmul_ops=10, attention_ops=4)
    traffic = Traffic(offloaded_bytes=4 * 10**9, hops=2, hop_bytes=10**9, hooked_modules=500)
    terms = call_terms(work, hand_profile(hook_seconds=2e-3), "bfloat16", traffic)
    assert terms == pytest.approx({"matmul": 2.0, "conv": 0.0, "attention": 2.0, "memory": 1.0 + 1.0, "cast": 0.0,
                                   "ops": 1.0, "offload": 1.0, "hops": 1.0, "hooks": 1.0})
    result = predict(work, traffic, hand_profile(hook_seconds=2e-3), "bfloat16", calls=2, steps=10, images_per_call=2,
                     queue=3, layout_steps={"split": 4.0, "cfg": 2.0})
    assert result["step_s"] == pytest.approx(20.0)  # 2 calls x 10 s
    assert result["image_s"] == pytest.approx(100.0)  # 10 steps x 20 s over 2 images per call
    assert result["queue_s"] == pytest.approx(600.0)  # 3 prompts of 10 steps
    assert result["layouts"]["cfg"]["step_s"] == pytest.approx(10.0)  # half the split's, as parallel.py predicts


def test_convolutions_are_priced_at_the_convolution_curve():
    """A convolution's FLOPs (a share of the matmul FLOPs the trace counts) go at the measured convolution rate, which
    for a few channels is far below a matmul's; a profile without one prices them as matmuls."""
    work = CallWork(matmul_flops=3e12, attention_flops=0, other_bytes=0, ops=0, weight_bytes=0, matmul_ops=3,
                    conv_flops=2e12, conv_ops=2)
    plain = call_terms(work, hand_profile(), "bfloat16", Traffic())
    assert plain["matmul"] + plain["conv"] == pytest.approx(3.0)  # every FLOP at the matmul rate of 1 TFLOP/s
    slow = call_terms(work, hand_profile(conv_curve={"bfloat16": [[1e6, 0.25], [1e15, 0.25]]}), "bfloat16", Traffic())
    assert slow["matmul"] == pytest.approx(1.0) and slow["conv"] == pytest.approx(8.0)  # 2e12 FLOPs at 0.25


def test_attention_counts_each_query_row():
    """Attention = scores x seconds per score + query rows x seconds per row + FLOPs / rate: the same scores over
    short keys (a cross-attention to 77 text tokens) are more rows, and cost more."""
    profile = hand_profile(score_seconds={"bfloat16": 1e-9}, row_seconds={"bfloat16": 1e-7})

    def attention(rows):
        work = CallWork(0, 1e9, 0, 0, 0, attention_ops=1, attention_scores=1e8, attention_rows=rows)
        return call_terms(work, profile, "bfloat16", Traffic())["attention"]

    assert attention(1e5) == pytest.approx(0.1 + 0.01 + 1e9 / 0.5e12)
    assert attention(1e6) - attention(1e5) == pytest.approx(9e5 * 1e-7)


def test_a_gpus_attention_runs_at_the_width_its_kernel_is_built_for():
    """On a GPU, attention takes the FLOPs of the head dim flash's kernel computes (40 as 64); a CPU, the call's own."""
    work = CallWork(0, 1e12, 0, 0, 0, attention_ops=1, attention_kernel_flops=1.6e12)
    gpu = call_terms(work, hand_profile(kind="gpu"), "bfloat16", Traffic())["attention"]
    cpu = call_terms(work, hand_profile(), "bfloat16", Traffic())["attention"]
    assert gpu == pytest.approx(1.6e12 / 0.5e12) and cpu == pytest.approx(1e12 / 0.5e12)
    older = CallWork(0, 1e12, 0, 0, 0, attention_ops=1)  # a trace made before the kernel's width was counted
    assert call_terms(older, hand_profile(kind="gpu"), "bfloat16", Traffic())["attention"] == pytest.approx(2.0)


def test_rates_are_read_off_the_measured_curve_by_op_size():
    profile = hand_profile(matmul_curve={"bfloat16": [[1e6, 1.0], [1e8, 100.0]]})
    assert profile.rate_at("matmul", "bfloat16", 1e7) == pytest.approx(10.0)  # log-log between the points
    assert profile.rate_at("matmul", "bfloat16", 1e3) == 1.0 and profile.rate_at("matmul", "bfloat16", 1e12) == 100.0
    assert profile.rate_at("attention", "bfloat16", 1e7) == 0.5  # no curve: the flat rate
    assert profile.rate_at("matmul", "float16", 1e7) == pytest.approx(10.0)  # half precision shares bfloat16's


def test_profile_round_trips_and_the_table_names_its_sources():
    measured = hand_profile(matmul_curve={"bfloat16": [[1e6, 1.0], [1e8, 2.0]]}, measured=True, source="here",
                            conv_curve={"float32": [[1e6, 0.1]]}, row_seconds={"bfloat16": 1e-7},
                            score_seconds={"bfloat16": 1e-9})
    assert DeviceProfile.from_json(json.loads(json.dumps(measured.to_json()))) == measured
    for name in GPU_TABLE:
        profile = table_profile(name)
        assert profile.source and profile.rate(profile.matmul_tflops, "bfloat16") > 0
        assert DeviceProfile.from_json(profile.to_json()) == profile


def test_calibrate_quick_on_cpu_writes_a_profile_that_plan_reads(tmp_path):
    path = tmp_path / "cpu.json"
    code, out, err = run_dmap("calibrate", "--quick", "--device", "cpu", "-o", path)
    assert code == 0, err
    profile = DeviceProfile.from_json(json.loads(path.read_text()))
    assert profile.kind == "cpu" and profile.measured and profile.op_seconds > 0
    assert set(profile.matmul_tflops) == {"float32", "bfloat16"} and profile.elementwise_gbps > 0
    assert profile.hook_seconds > 0 and profile.host_gbps > 0
    assert len(profile.matmul_curve["float32"]) == 2
    assert len(profile.conv_curve["float32"]) == 2 and profile.row_seconds["float32"] > 0
    code, out, err = run_dmap("plan", "tiny-flux", "--profile", path, "--steps", "7", "--queue", "3", "--json")
    assert code in (0, 1), err
    predicted = json.loads(out)["predicted_time"]
    assert predicted["profile"] == profile.name and predicted["profile_origin"] == "file"
    assert predicted["step_s"] > 0 and predicted["image_s"] == pytest.approx(7 * predicted["step_s"], rel=1e-3)
    assert predicted["queue_s"] == pytest.approx(3 * predicted["image_s"], rel=1e-3)
    code, out, err = run_dmap("calibrate", "--quick", "--device", "cpu", "-o", path)  # exists: refused
    assert code == 2 and "Traceback" not in err


def test_calibrated_profile_in_the_cache_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("DMAP_CACHE_DIR", str(tmp_path / "cache"))  # not the session's: other tests expect none
    code, _, err = run_dmap("calibrate", "--quick", "--device", "cpu", "--force")  # busy or not
    assert code == 0, err
    code, out, err = run_dmap("plan", "tiny-flux", "-m", "cpu=8GB", "--json")
    assert json.loads(out)["predicted_time"]["profile_origin"] == "cached"
    code, out, err = run_dmap("plan", "tiny-flux", "-m", "0=8GB", "--json")  # a CPU's profile says nothing of a GPU
    assert json.loads(out)["predicted_time"]["profile_origin"] == "default"


@pytest.mark.parametrize("document", [
    "not json", json.dumps({"format": "dmap-device-profile", "version": 1}), json.dumps([1, 2]),
    json.dumps({**table_profile("l40s").to_json(), "memory_gbps": -1}),
    json.dumps({**table_profile("l40s").to_json(), "matmul_tflops": {"int4": 5}}),
    json.dumps({**table_profile("l40s").to_json(), "matmul_curve": {"bfloat16": [[1e8, 1], [1e6, 2]]}}),
    json.dumps({**table_profile("l40s").to_json(), "op_seconds": "fast"}),
    json.dumps({**table_profile("l40s").to_json(), "kind": "tpu"}),
])
def test_a_bad_profile_is_refused_in_one_sentence(tmp_path, document):
    path = tmp_path / "bad.json"
    path.write_text(document)
    code, out, err = run_dmap("plan", "tiny-flux", "--profile", path)
    assert code == 2, (out, err)
    assert err.startswith("Error: The device profile") and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("args", [["--profile", "/no/such/profile.json"], ["--profile", "table:tpu-v9"],
                                  ["--steps", "0"], ["--queue", "0"]])
def test_bad_prediction_options_exit_2(args):
    code, _, err = run_dmap("plan", "tiny-flux", *args)
    assert code == 2 and "Traceback" not in err


def test_plan_prints_predicted_times_per_step_image_and_queue():
    code, out, err = run_dmap("plan", "tiny-flux", "-m", "0=8GB", "--steps", "4", "--queue", "5",
                              env={"COLUMNS": "200"})
    assert code in (0, 1), err
    assert "Predicted denoise time" in out and "at 4 steps" in out and "for a queue of 5" in out
    assert "Device profile: default" in out


def test_parallel_auto_uses_the_profile_and_prints_each_layout():
    code, out, err = run_dmap("plan", "flux", "-m", "0=80GB,1=80GB,cpu=64GB", "--world-size", "2", "--dtype",
                              "bfloat16", "--profile", "table:h100-sxm", "--no-check", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["parallel"]["device_tflops"] == 989.0 and data["parallel"]["link_gbps"] == 450.0
    layouts = data["predicted_time"]["layouts"]
    assert set(layouts) == set(data["parallel"]["predicted_step_s"]) and "split" in layouts
    code, out, err = run_dmap("plan", "flux", "-m", "0=80GB,1=80GB,cpu=64GB", "--world-size", "2", "--dtype",
                              "bfloat16", "--profile", "table:h100-sxm", "--no-check", env={"COLUMNS": "200"})
    assert "  split: " in out and "per queue" in out


@pytest.mark.parametrize("hostile", [[1], {"step_s": float("nan")}, {"step_s": [1, 2]}, {"a": {"b": {"c": {"d": 1}}}},
                                     {str(i): 1 for i in range(201)}, {"step_s": True}])
def test_a_plan_file_with_a_malformed_prediction_is_refused(tmp_path, hostile):
    from dm_cli.planning.plan_file import Plan

    path = tmp_path / "plan.json"
    code, _, err = run_dmap("plan", "tiny-flux", "-q", "--no-check", "-o", path)
    assert code == 0, err
    data = json.loads(path.read_text())
    assert Plan.from_json(data).to_json() == data  # the prediction reads back as written
    with pytest.raises(ValueError):
        Plan.from_json({**data, "predicted_time": hostile})


CPU_PROFILE = Path(tempfile.mkdtemp(prefix="dmap-cpu-profile-")) / "cpu.json"
CPU_PROFILE.write_text(json.dumps(hand_profile(name="hand-cpu", op_seconds=1e-5).to_json()))


def predicted(*args) -> dict:
    """The plan's predicted time; a CPU plan on a stated CPU profile (with none, a CPU plan predicts nothing)."""
    args = args if "--profile" in args else (*args, "--profile", str(CPU_PROFILE))
    code, out, err = run_dmap("plan", *args, "--no-check", "--json")
    assert code in (0, 1), err
    return json.loads(out)["predicted_time"]


def test_a_unets_convolutions_are_counted_apart():
    """The trace counts a UNet's convolutions apart from its matmuls (the transformer has none)."""
    assert predicted("tiny-sd15", "--height", "64", "--width", "64")["step_terms_s"]["conv"] > 0
    assert predicted("tiny-flux", "--height", "64", "--width", "64")["step_terms_s"]["conv"] == 0


def test_qwen_image_calls_twice_per_step_only_with_a_negative_prompt():
    """QwenImagePipeline's true CFG (the second call) runs only with a negative prompt; the plan's memory view
    counts it anyway, the time prediction only when it runs."""
    alone = predicted("tiny-qwenimage", "--height", "64", "--width", "64")
    both = predicted("tiny-qwenimage", "--height", "64", "--width", "64", "--negative-prompt", "blurry")
    assert alone["calls_per_step"] == 1 and both["calls_per_step"] == 2
    assert both["step_s"] == pytest.approx(2 * alone["step_s"], rel=1e-3)


@pytest.fixture(scope="module")
def text_pipelines(tmp_path_factory):
    """Tiny Qwen-Image, Z-Image and FLUX folders with their tokenizers (random weights)."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("text")
    return {name: write_random_pipeline(PRESETS_DIR / name, root / name) for name in
            ("tiny-qwenimage", "tiny-zimage", "tiny-flux")}


@pytest.mark.parametrize("name", ["tiny-qwenimage", "tiny-zimage"])
def test_predicted_time_grows_with_the_text_length_the_pipeline_runs(text_pipelines, name):
    """Qwen-Image and Z-Image drop the text's padding: the denoiser runs the prompt's own tokens, fewer than the
    maximum the plan traces for memory, and more of them take longer."""
    size = ["--height", "128", "--width", "128"]
    longest = predicted(text_pipelines[name], *size)
    short = predicted(text_pipelines[name], *size, "--prompt", "a cat")
    long = predicted(text_pipelines[name], *size, "--prompt", "a cat " * 60)
    assert "text_tokens" not in longest  # no prompt: the longest text, as traced
    assert short["text_tokens"] < long["text_tokens"]
    assert short["step_s"] < long["step_s"] < longest["step_s"]


def test_flux_pads_the_text_so_the_prompt_does_not_change_its_time(text_pipelines):
    size = ["--height", "64", "--width", "64"]
    assert predicted(text_pipelines["tiny-flux"], *size, "--prompt", "a cat") == predicted(text_pipelines["tiny-flux"],
                                                                                             *size)


# --- the link between ranks: a latency per exchange (CPU ranks over gloo) ----------------------------------------


def _flux_shape():
    from dm_cli.planning.parallel.parallel import DenoiserShape

    return DenoiserShape("FluxTransformer2DModel", heads=4, hidden=256, layers=6, image_tokens=256, text_tokens=64,
                         batch=1, calls=1, element_bytes=4, prediction_bytes=256 * 64 * 4)


def test_each_layouts_exchanges_pay_the_links_latency():
    """Ulysses: 4 all-to-alls per attention layer and call plus the output's gather; CFG: one gather per step; a
    pipeline hop: a header and two tensors; the split (one process): none."""
    from dm_cli.planning.parallel.parallel import (
        HOP_MESSAGES,
        Candidate,
        DenoiserLoad,
        Guidance,
        ParallelRequest,
        PipelineCut,
        pipeline_seconds,
        step_seconds,
    )

    shape, load = _flux_shape(), DenoiserLoad((10**6,), 10**6, 10**6)
    bytes_only = ParallelRequest(2, "auto", 1.0, 1.0).settled()
    slow = ParallelRequest(2, "auto", 1.0, 1.0, link_latency_s=1e-3).settled()
    batch_cfg = Guidance("batch", 2)
    extra = {cand.layout: step_seconds(cand, shape, batch_cfg, load, slow) - step_seconds(cand, shape, batch_cfg, load,
                                                                                         bytes_only)
             for cand in (Candidate("split"), Candidate("cfg", cfg=2), Candidate("context", ulysses=2))}
    assert extra == pytest.approx({"split": 0.0, "cfg": 1e-3, "context": (4 * 6 + 1) * 1e-3})
    cut = PipelineCut((("transformer_blocks.0",), ("transformer_blocks.1",)), {}, (1, 1), (1e9, 1e9), 0)
    (split0, piped0), (split1, piped1) = (pipeline_seconds(cut, shape, r, 2) for r in (bytes_only, slow))
    assert split1 - split0 == pytest.approx(HOP_MESSAGES * 1e-3)  # one cut: one hop
    assert piped1 - piped0 == pytest.approx(HOP_MESSAGES * 1e-3)  # the slowest slice and its hop


def test_a_profiles_link_latency_is_optional_and_checked():
    profile = hand_profile(link_latency_s=5e-5, kind="cpu")
    assert DeviceProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    old = hand_profile().to_json()  # a profile written before the key: bytes alone
    assert "link_latency_s" not in old and DeviceProfile.from_json(old).link_latency_s == 0.0
    with pytest.raises(ValueError, match="link_latency_s"):
        DeviceProfile.from_json({**old, "link_latency_s": -1})


def _context_plan(tmp_path, latency: float, *extra) -> dict:
    path = tmp_path / f"profile-{latency}.json"
    path.write_text(json.dumps(hand_profile(kind="cpu", link_latency_s=latency, matmul_tflops={"float32": 1e-4,
                                                                                                "bfloat16": 1e-4}).to_json()))
    code, out, err = run_dmap("plan", "tiny-flux", "--height", "64", "--width", "64", "-m", "0=1GB,1=1GB",
                              "--world-size", "2", "--profile", path, "--no-check", "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_parallel_layouts_are_predicted_with_the_profiles_link_latency(tmp_path):
    """The profile's latency reaches `--parallel`'s time model (a given --link-gbps describes the link alone)."""
    from dm_cli.planning.parallel.parallel import ULYSSES_MESSAGES

    fast, slow = (_context_plan(tmp_path, latency, "--parallel", "context")["parallel"] for latency in (0.0, 1e-3))
    layers = 2  # tiny-flux: 1 double and 1 single block, each one attention
    assert slow["predicted_step_s"]["context"] - fast["predicted_step_s"]["context"] == pytest.approx(
        (ULYSSES_MESSAGES * layers + 1) * 1e-3, abs=2e-4)
    assert slow["predicted_step_s"]["split"] == fast["predicted_step_s"]["split"]
    given = _context_plan(tmp_path, 1e-3, "--parallel", "context", "--link-gbps", "2")["parallel"]
    assert given["predicted_step_s"] == fast["predicted_step_s"]


def test_the_pipelines_time_is_on_the_splits_basis(tmp_path):
    """`auto` compares the pipeline with the split at the pipeline's own speed-up over its cut (it had counted its
    slices' FLOPs against the split's 2 x params x every token: pipeline on 2 ranks 3.2x the split on the demo)."""
    import re

    data = _context_plan(tmp_path, 0.0, "--parallel", "auto")["parallel"]
    speedup = float(re.search(r"predicted ([0-9.]+)x the split's", data["rejected"]["pipeline"]).group(1))
    times = data["predicted_step_s"]
    assert times["split"] / times["pipeline"] == pytest.approx(speedup, rel=0.02)


def test_calibrate_on_a_cpu_measures_gloo_between_two_processes():
    """A spawned pair of processes (seconds): the link CPU ranks exchange over, its rate and latency per message."""
    from dataclasses import replace

    from dm_cli.planning.time.calibrate import CalibrationSizes, calibrate

    profile = calibrate(replace(CalibrationSizes.quick(), link_mib=1), device="cpu")
    assert "gloo" in profile.link and profile.link_latency_s > 0 and profile.link_gbps > 0
    assert profile.collective_latency_s > 0 and profile.collective_gbps > 0  # an all-to-all as diffusers makes it
    assert DeviceProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


def test_parallel_layouts_are_rated_at_the_plans_dtype(tmp_path):
    """A plan without --dtype runs at the checkpoint's (the demo's float32): `--parallel`'s time model takes the profile's
    float32 rate and 4-byte activations, not bfloat16's (on this CPU 7x faster, which made the exchanges 7x their share)."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(hand_profile(kind="cpu", matmul_tflops={"float32": 0.25, "bfloat16": 2.0}).to_json()))
    found = {}
    for dtype in ([], ["--dtype", "bfloat16"]):
        code, out, err = run_dmap("plan", "demo", "--height", "64", "--width", "64", "-m", "0=1GB,1=1GB",
                                  "--world-size", "2", "--profile", path, "--no-check", "--json", *dtype)
        assert code == 0, err
        data = json.loads(out)
        found[data["dtype"]] = data["parallel"]["device_tflops"]
    assert found == {"float32": 0.25, "bfloat16": 2.0}


def test_on_a_calibrated_profile_the_layouts_share_the_detailed_compute(tmp_path):
    """The split's step in `--parallel`'s model is the detailed model's step (its FLOPs per step rated to take the
    traced denoiser's compute seconds), so that the exchanges' seconds weigh against the compute a step really has."""
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(hand_profile(kind="cpu", measured=True, link_latency_s=1e-4,
                                            matmul_tflops={"float32": 1e-3, "bfloat16": 1e-3}).to_json()))
    code, out, err = run_dmap("plan", "demo", "--height", "64", "--width", "64", "-m", "0=1GB,1=1GB", "--world-size",
                              "2", "--parallel", "context", "--profile", path, "--no-check", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["parallel"]["predicted_step_s"]["split"] == pytest.approx(data["predicted_time"]["step_s"], rel=0.01)


def test_a_ranks_share_of_a_call_keeps_what_does_not_divide():
    """Under cfg and context every rank dispatches every op of the call and reads every weight (a pipeline slice its
    share of both), and a share of the tokens runs its matmuls at the smaller op's rate on the measured curve."""
    from dm_cli.planning.time.step_time import RankCompute

    work = CallWork(matmul_flops=4e9, attention_flops=0.0, other_bytes=0.0, ops=1000, weight_bytes=2 * 10**9,
                    matmul_ops=10)
    curve = {"bfloat16": [[1e6, 0.5], [1e9, 1.0]]}  # half the op size: a lower rate
    model = RankCompute(work, hand_profile(matmul_curve=curve), "bfloat16")
    terms = call_terms(work, hand_profile(matmul_curve=curve), "bfloat16", Traffic())
    assert model.call_s() == pytest.approx(sum(terms.values()))
    fixed = terms["ops"] + terms["memory"]  # 1000 ops x 1 ms, 2 GB of weights at 2 GB/s: every rank's
    half = model.call_s(0.5)
    assert half - fixed > terms["matmul"] / 2  # the half-size matmuls run slower per FLOP
    assert half == pytest.approx(fixed + 2e9 / (1e12 * _rate_at(curve, 2e8)), rel=1e-6)  # 10 ops of 2e8 FLOPs
    # a slice: half the ops and weights, its 5 matmuls as large as the whole call's
    assert model.call_s(0.5, divide_ops=True) == pytest.approx(fixed / 2 + 2e9 / (1e12 * _rate_at(curve, 4e8)))


def _rate_at(curve, flops_per_op: float) -> float:
    import math

    (x0, y0), (x1, y1) = curve["bfloat16"]
    t = math.log(flops_per_op / x0) / math.log(x1 / x0)
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def test_on_a_calibrated_profile_a_layout_pays_each_ranks_fixed_costs(tmp_path):
    """A profile whose op costs dominate a small model's call (as a CPU's do): context parallel on two ranks divides
    the FLOPs but not the ops each rank dispatches, so its predicted step is no longer the split's over two, and with
    a collective's latency on top it is slower than the split, which `auto` then keeps (on two CPU ranks the demo at
    256x256 measured one rank 77% faster than context, which auto had picked)."""
    path = tmp_path / "ops.json"
    path.write_text(json.dumps(hand_profile(kind="cpu", measured=True, op_seconds=1e-4, link_latency_s=1e-5,
                                            collective_latency_s=2e-4, matmul_tflops={"float32": 1.0, "bfloat16": 1.0},
                                            memory_gbps=1000.0, elementwise_gbps=1000.0).to_json()))
    code, out, err = run_dmap("plan", "demo", "--height", "64", "--width", "64", "-m", "0=1GB,1=1GB", "--world-size",
                              "2", "--parallel", "auto", "--profile", path, "--no-check", "--json")
    assert code == 0, err
    data = json.loads(out)
    times = data["parallel"]["predicted_step_s"]
    assert times["context"] > times["split"] / 2 + 0.9 * data["predicted_time"]["step_terms_s"]["ops"] / 2
    assert data["parallel"]["layout"] == "split", data["parallel"]["reason"]


def test_a_profiles_collective_latency_and_rate_are_optional_and_checked():
    profile = hand_profile(kind="cpu", link_latency_s=5e-5, collective_latency_s=4e-4, collective_gbps=1.5)
    assert DeviceProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    old = hand_profile().to_json()
    assert "collective_latency_s" not in old and DeviceProfile.from_json(old).collective_latency_s == 0.0
    assert "collective_gbps" not in old and DeviceProfile.from_json(old).collective_gbps == 0.0
    with pytest.raises(ValueError, match="collective_latency_s"):
        DeviceProfile.from_json({**old, "collective_latency_s": 2})
    with pytest.raises(ValueError, match="collective_gbps"):
        DeviceProfile.from_json({**old, "collective_gbps": -1})


def test_ulysses_and_cfg_pay_the_collectives_latency():
    """Where calibrated, each collective (Ulysses' all-to-alls, CFG's gather) costs the collective's latency, not a
    message's; a pipeline hop's point-to-point messages keep the link's."""
    from dm_cli.planning.parallel.parallel import Candidate, DenoiserLoad, Guidance, ParallelRequest, step_seconds

    shape, load = _flux_shape(), DenoiserLoad((10**6,), 10**6, 10**6)
    message = ParallelRequest(2, "auto", 1.0, 1.0, link_latency_s=1e-4).settled()
    both = ParallelRequest(2, "auto", 1.0, 1.0, link_latency_s=1e-4, collective_latency_s=1e-3).settled()
    batch_cfg = Guidance("batch", 2)
    extra = {cand.layout: step_seconds(cand, shape, batch_cfg, load, both) - step_seconds(cand, shape, batch_cfg, load,
                                                                                         message)
             for cand in (Candidate("cfg", cfg=2), Candidate("context", ulysses=2))}
    assert extra == pytest.approx({"cfg": 9e-4, "context": (4 * 6 + 1) * 9e-4})


def test_ulysses_moves_its_bytes_at_the_collectives_rate_and_copies_them_on_the_device():
    """An all-to-all's bytes go at the calibrated all-to-all rate (gloo's measured 1.6-2.9 GB/s where a send measured
    4.5-5.2), and with the detailed model each of q, k, v and out is copied into the all-to-all's layout and back
    (read and written twice) at the elementwise rate, by the ops diffusers' Ulysses adds to each attention layer."""
    from dataclasses import replace

    from dm_cli.planning.parallel.parallel import (
        ULYSSES_OPS_PER_LAYER,
        Candidate,
        DenoiserLoad,
        Guidance,
        ParallelRequest,
        step_seconds,
    )
    from dm_cli.planning.time.step_time import RankCompute

    shape, load = _flux_shape(), DenoiserLoad((10**6,), 10**6, 10**6)
    context, batch_cfg = Candidate("context", ulysses=2), Guidance("batch", 2)
    link = ParallelRequest(2, "auto", 1.0, 1.0).settled()
    slower = ParallelRequest(2, "auto", 1.0, 1.0, collective_gbps=0.5).settled()
    per_layer = 4 * (shape.split_tokens / 2) * shape.hidden * shape.element_bytes / 2  # each rank sends half
    moved = per_layer * shape.layers * shape.batch * shape.calls
    assert step_seconds(context, shape, batch_cfg, load, slower) - step_seconds(context, shape, batch_cfg, load, link) \
        == pytest.approx(moved / 0.5e9 - moved / 1e9)
    work = CallWork(matmul_flops=1e9, attention_flops=0.0, other_bytes=0.0, ops=10, weight_bytes=0)
    model = RankCompute(work, hand_profile(elementwise_gbps=2.0), "bfloat16")
    modelled = replace(link, compute=model)
    copies = 4 * 2 * 2 * (shape.split_tokens / 2) * shape.hidden * shape.element_bytes * shape.layers * shape.batch \
        * shape.calls
    ulysses_ops = ULYSSES_OPS_PER_LAYER * shape.layers * shape.calls * 1e-3  # the hand profile's 1 ms an op
    assert step_seconds(context, shape, batch_cfg, load, modelled) == pytest.approx(
        model.call_s(0.5) * shape.calls + moved / 1e9 + copies / 2e9 + ulysses_ops)  # no latency given


def test_every_pipeline_slice_runs_the_modules_outside_the_blocks():
    """A slice's call is its share of the blocks plus all the work outside the block lists (the embedders and output
    layers, which every rank of a pipeline runs; the trace counts them apart: test_trace.py)."""
    from dm_cli.planning.time.step_time import RankCompute

    work = CallWork(matmul_flops=1e9, attention_flops=0.0, other_bytes=0.0, ops=1000, weight_bytes=0, matmul_ops=0,
                    outside_ops=200, outside_flops=2e8)
    profile = hand_profile(matmul_tflops={"bfloat16": 1e-3})
    whole, half = RankCompute(work, profile, "bfloat16").call_s(), RankCompute(work, profile, "bfloat16").call_s(
        0.5, divide_ops=True)
    assert half == pytest.approx((800 / 2 + 200) * 1e-3 + (8e8 / 2 + 2e8) / 1e9)
    assert half > whole / 2


def test_a_pipelines_split_runs_the_work_outside_the_blocks_once():
    """The cut's split (one process: the slices one after another) runs the embedders and output layers once, where
    each pipeline slice runs them again: summing the slices counted them twice and so made the pipeline's speed-up
    over the split look larger than it is."""
    from dataclasses import replace

    from dm_cli.planning.parallel.parallel import ParallelRequest, PipelineCut, pipeline_seconds
    from dm_cli.planning.time.step_time import RankCompute

    work = CallWork(matmul_flops=1e9, attention_flops=0.0, other_bytes=0.0, ops=1000, weight_bytes=0, matmul_ops=0,
                    outside_ops=200, outside_flops=2e8)
    model = RankCompute(work, hand_profile(matmul_tflops={"bfloat16": 1e-3}), "bfloat16")
    request = replace(ParallelRequest(2, "pipeline", 1.0, 1e6).settled(), compute=model)
    cut = PipelineCut((("transformer_blocks.0",), ("transformer_blocks.1",)), {}, (1, 1), (1e9, 1e9), 0)
    shape = _flux_shape()
    split, piped = pipeline_seconds(cut, shape, request, 2)
    hop = shape.hop_bytes / 1e15 * shape.calls
    assert split == pytest.approx(model.call_s() * shape.calls + hop)
    assert piped == pytest.approx(model.call_s(0.5, divide_ops=True) * shape.calls + hop)
    assert piped > split / 2  # the slices' own embedders: less than the cut's ideal 2x
