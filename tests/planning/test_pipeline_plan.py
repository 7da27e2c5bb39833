"""`dmap plan --world-size N --parallel pipeline`: the denoiser's blocks cut into one contiguous slice per rank
(dm_cli/planning/parallel/parallel.py `pipeline_cut`), that cut as the plan's device map, per-rank memory and the predicted
speed-up. Config-only presets, no weights; each traced model is planned once per module and shared.

Balance bound checked on the real models: the predicted speed-up (split / pipeline, per-slice FLOPs) is at least
0.9 x the world size, i.e. the slowest rank's slice and hop take at most 1/0.9 of the mean; and for the pure cut,
the largest slice is at most the mean plus the largest block (what the best contiguous cut can always reach).
"""

import itertools
import json
import re

import pytest
from conftest import run_dmap

from dm_cli.errors import UsageError
from dm_cli.planning.parallel.parallel import (
    DenoiserShape,
    ParallelRequest,
    PipelineCut,
    Unit,
    balanced_cut,
    list_entry,
    pipeline_cut,
    pipeline_rank_peak,
    pipeline_seconds,
)

GB = 10**9
TINY = ("tiny-flux", "-m", "0=1GB,1=1GB", "--height", "64", "--width", "64")


def _plan(tmp_path_factory, *args, check=False):
    """(plan JSON, the plan file, the tables at 200 columns) of one `dmap plan`."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    code, out, err = run_dmap("plan", *args, *(() if check else ("--no-check",)), "-o", path, env={"COLUMNS": "200"})
    assert code == 0, err
    return json.loads(path.read_text()), path, out


def _one_sentence_refusal(code, err, *fragments, exit_code=2):
    assert code == exit_code, err
    message = err.strip().splitlines()[-1]
    assert message.startswith("Error: ") and message.endswith("."), message
    assert len(re.findall(r"[.:] [A-Z]", message[7:])) == 0, message  # one sentence
    for fragment in fragments:
        assert fragment in message, message


def _check_cut(data: dict, world: int, denoiser: str = "transformer") -> dict:
    """The cut as the plan records it: slices contiguous, in execution order, every block-list entry once, slice r
    on GPU r, the modules before the blocks on GPU 0 and those after on the last; nothing off the GPUs. Returns
    rank -> the device_map keys on its GPU."""
    layout = data["parallel"]
    device_map = data["components"][denoiser]["device_map"]
    assert (layout["layout"], layout["cfg"], layout["ulysses"], layout["world_size"]) == ("pipeline", 1, 1, world)
    assert sorted(layout["slices"], key=int) == [str(r) for r in range(world)]
    entries = list(dict.fromkeys(e for e in map(list_entry, device_map) if e))  # execution order
    assert [e for r in range(world) for e in layout["slices"][str(r)]] == entries  # contiguous, each once, in order
    assert all(layout["slices"][str(r)] for r in range(world))
    first = next(i for i, key in enumerate(device_map) if list_entry(key))
    last = max(i for i, key in enumerate(device_map) if list_entry(key))
    on_gpu: dict[int, list[str]] = {}
    for i, (key, device) in enumerate(device_map.items()):
        entry = list_entry(key)
        rank = next((r for r in range(world) if entry in layout["slices"][str(r)]), None) if entry else (
            0 if i < first else world - 1 if i > last else None)
        if rank is not None:
            assert device == rank, (key, device, rank)
        on_gpu.setdefault(device, []).append(key)
    assert set(on_gpu) == set(range(world)) and data["components"][denoiser]["offloaded_bytes"] == 0
    return on_gpu


def _denoise_peaks(data: dict) -> dict[str, int]:
    stage = next(s for s in data["stages"] if s["name"] == "denoise")
    return {k: sum(v.values()) for k, v in stage["breakdown"].items()}


# --- tiny-flux: 1 double + 1 single block on two ranks ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _plan(tmp_path_factory, *TINY, "--world-size", "2", "--parallel", "pipeline", check=True)


def test_tiny_flux_cut_is_the_device_map(tiny):
    data, _, _ = tiny
    layout = data["parallel"]
    assert data["components"]["transformer"]["device_map"] == {
        "x_embedder": 0, "time_text_embed": 0, "context_embedder": 0, "transformer_blocks.0": 0,
        "single_transformer_blocks.0": 1, "norm_out": 1, "proj_out": 1}
    assert layout["slices"] == {"0": ["transformer_blocks.0"], "1": ["single_transformer_blocks.0"]}
    assert layout["in_flight"] == 2 and layout["speedup_basis"] == "per-slice FLOPs from the configs"
    assert set(layout["predicted_step_s"]) == {"split", "pipeline"} and layout["predicted_speedup"] > 1
    assert data["check"]["ran"] and data["check"]["components"] == ["transformer"] and not data["check"]["problems"]
    assert data["mode"] == "staged" and set(_denoise_peaks(data)) == {"0", "1"}
    _check_cut(data, 2)


def test_tiny_flux_render_shows_slices_and_speedup(tiny):
    _, _, out = tiny
    assert "Parallel: pipeline parallel (2 slices), world size 2, 2 queue prompts in flight" in out
    assert re.search(r"0\s.*GPU 0\s.*transformer_blocks\.0 \(1\)", out), out
    assert re.search(r"1\s.*GPU 1\s.*single_transformer_blocks\.0 \(1\)", out), out
    assert re.search(r"predicted speed-up: [\d.]+x the split's images per second for a queue \(1x for one prompt\); "
                     r"basis: per-slice FLOPs from the configs", out), out
    assert "pipeline parallel (2 slices), as asked: predicted" in out


def test_a_pipeline_plan_reads_back(tiny):
    from dm_cli.planning.plan_file import load_plan

    data, path, _ = tiny
    assert load_plan(path).to_json() == data


@pytest.mark.parametrize("hostile, fragment", [
    ({"slices": None}, "slices must be a JSON object"),
    ({"slices": {"0": ["transformer_blocks.0"]}}, "slices must name ranks 0 to 1"),
    ({"slices": {"0": ["transformer_blocks.0"], "1": []}}, "slice 1 must be a non-empty list"),
    ({"slices": {"0": ["transformer_blocks.0"], "1": [7]}}, "slice 1 must be a non-empty list"),
    ({"slices": {"0": ["transformer_blocks.0"], "1": ["a b"]}}, "slice 1 must be a non-empty list"),
    ({"slices": {"0": ["transformer_blocks.0"], "1": ["transformer_blocks.0"]}}, "name a block twice"),
    ({"in_flight": 0}, "in_flight must be a whole number from 1 to 1024"),
    ({"in_flight": 1025}, "in_flight must be"),
    ({"in_flight": True}, "in_flight must be"),
    ({"in_flight": 2.5}, "in_flight must be"),
    ({"in_flight": None}, "in_flight must be"),
    ({"predicted_speedup": -1}, "predicted_speedup must be"),
    ({"speedup_basis": 3}, "speedup_basis must be a string"),
    ({"cfg": 2}, "pipeline with cfg 2"),
    ({"ulysses": 2}, "pipeline with cfg 1 x ulysses 2"),
    ({"layout": "context", "ulysses": 2}, "slices belongs to the pipeline layout, not context"),
    ({"layout": "ring"}, "layout must be"),
])
def test_a_hostile_pipeline_key_is_refused(tiny, tmp_path, hostile, fragment):
    from dm_cli.planning.plan_file import load_plan

    data = json.loads(json.dumps(tiny[0]))
    data["parallel"].update(hostile)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=r"is not a dmap plan \(.*'parallel'.*\): write one") as caught:
        load_plan(path)
    assert caught.value.exit_code == 2 and str(caught.value).count(". ") == 0 and fragment in str(caught.value)


def test_a_plan_without_the_pipeline_fields_still_loads(tiny, tmp_path):
    """Plan files written before pipeline parallel: a split layout with no slices or in_flight."""
    from dm_cli.planning.plan_file import load_plan

    data = json.loads(json.dumps(tiny[0]))
    for key in ("slices", "in_flight", "predicted_speedup", "speedup_basis"):
        del data["parallel"][key]
    data["parallel"].update(layout="split", predicted_step_s={"split": 0.1})
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_plan(path).to_json()["parallel"] == data["parallel"]


def test_in_flight_sizes_the_buffers_through_the_api():
    from dm_cli import api

    def plan(**extra):
        return api.plan("tiny-flux", max_memory="0=1GB,1=1GB", height=64, width=64, world_size=2, parallel="pipeline",
                        check=False, **extra)

    default, one = plan(), plan(in_flight=1)
    assert (default.parallel.in_flight, one.parallel.in_flight) == (2, 1)  # one per rank by default
    # (64/2)^2 = 1024 image tokens (the tiny VAE does not downsample; 2x2 packing) + 512 text tokens, hidden 2 x 16,
    # bf16, batch 1: 1 micro-batch fewer in flight, a send and a receive buffer
    hop = (1024 + 512) * 32 * 2
    assert default.parallel.per_rank_peak_bytes["1"] - one.parallel.per_rank_peak_bytes["1"] == 1 * 2 * hop
    assert default.components["transformer"].device_map == one.components["transformer"].device_map


# --- FLUX.1 [dev] on two 16 GB GPUs: the whole denoiser fits neither ------------------------------------------------


@pytest.fixture(scope="module")
def flux_auto(tmp_path_factory):
    return _plan(tmp_path_factory, "flux", "-m", "0=16GB,1=16GB", "--height", "1024", "--width", "1024",
                 "--world-size", "2", check=True)


def test_auto_picks_pipeline_when_the_denoiser_fits_no_gpu(flux_auto):
    data, _, _ = flux_auto
    layout = data["parallel"]
    on_gpu = _check_cut(data, 2)
    assert on_gpu[0][:3] == ["x_embedder", "time_text_embed", "context_embedder"]
    assert on_gpu[1][-2:] == ["norm_out", "proj_out"]
    assert "context parallel (Ulysses 2) does not fit" in layout["rejected"]["context"]
    assert "guidance-distilled" in layout["rejected"]["cfg"]
    assert layout["reason"].startswith("pipeline parallel (2 slices), as no layout that shares every step fits: "
                                       "predicted ")
    assert not data["check"]["problems"] and data["check"]["components"] == ["transformer"]
    # 16 GB each: the fastest cut (equal FLOPs) would overfill rank 0 with FLUX's weight-heavy double blocks, so the
    # cut is the fastest that fits (`room`), a little short of the balance bound 0.9 x N of unconstrained cuts
    assert 1.6 <= layout["predicted_speedup"] < 0.9 * 2
    times = layout["predicted_step_s"]
    assert times["pipeline"] < times["split"] and round(times["split"] / times["pipeline"], 1) == round(
        layout["predicted_speedup"], 1)


def test_flux_per_rank_memory_is_half_the_weights_and_the_extras(flux_auto):
    data, _, _ = flux_auto
    layout = data["parallel"]
    weights = data["components"]["transformer"]["weights_bytes"]  # 23.8 GB
    activations = data["components"]["transformer"]["activation_peak_bytes"]
    hop = (4096 + 512) * 3072 * 2  # 64 x 64 latent tokens + 512 text tokens, hidden 3072, bf16
    extras = activations + 4 * 2 * hop + 600 * 10**6  # 4 micro-batches in flight (2 x 2 ranks), GPU overhead
    single = _denoise_peaks(data)
    encode = next(s for s in data["stages"] if s["name"] == "encode")
    for rank in "01":
        peak = layout["per_rank_peak_bytes"][rank]
        assert peak <= 16 * GB
        # the fastest cut that fits fills rank 0 to its 16 GB (0.61 of the weights), not an even half
        assert 0.35 * weights < peak - extras < 0.65 * weights or rank in encode["breakdown"] and peak == sum(
            encode["breakdown"][rank].values())
        assert peak >= single[rank]  # a rank holds more than the single-process split puts on its GPU
    assert all(peak <= 16 * GB for peak in single.values())


def test_flux_explicit_pipeline_is_the_same_cut(flux_auto, tmp_path_factory):
    data, _, _ = _plan(tmp_path_factory, "flux", "-m", "0=16GB,1=16GB", "--height", "1024", "--width", "1024",
                       "--world-size", "2", "--parallel", "pipeline")
    assert data["components"]["transformer"]["device_map"] == flux_auto[0]["components"]["transformer"]["device_map"]
    assert data["parallel"]["slices"] == flux_auto[0]["parallel"]["slices"]
    assert data["parallel"]["reason"].startswith("pipeline parallel (2 slices), as asked: ")


def test_auto_keeps_context_when_the_denoiser_fits_one_gpu(tmp_path_factory):
    data, _, _ = _plan(tmp_path_factory, "flux", "-m", "0=80GB,1=80GB", "--height", "1024", "--width", "1024",
                       "--world-size", "2")
    layout = data["parallel"]
    assert layout["layout"] == "context" and "slices" not in layout and "in_flight" not in layout
    assert "layouts that share every step when one fits (context does here)" in layout["rejected"]["pipeline"]
    assert set(data["components"]["transformer"]["device_map"].values()) <= {0, 1}


def test_a_rank_that_does_not_fit_is_refused():
    code, _, err = run_dmap("plan", "flux", "-m", "0=12GB,1=12GB", "--height", "1024", "--width", "1024",
                            "--world-size", "2", "--parallel", "pipeline", "--no-check")
    _one_sentence_refusal(code, err, "pipeline parallel does not fit: rank 0 needs", "of GPU 0's 12.00 GB",
                          "micro-batches in flight", exit_code=3)


# --- FLUX.2 [dev], Qwen-Image, Wan 2.2 TI2V 5B at 2 and 4 ranks ----------------------------------------------------

MODELS = {
    "flux2": ("--height", "512", "--width", "512"),
    "qwen-image": ("--height", "512", "--width", "512"),
    "wan2.2-ti2v-5b": ("--height", "256", "--width", "448", "--frames", "5"),
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", list(MODELS))
def test_real_models_cut_over_two_and_four_ranks(tmp_path_factory, model, world):
    spec = ",".join(f"{r}=80GB" for r in range(world))
    data, _, _ = _plan(tmp_path_factory, model, "-m", spec, *MODELS[model], "--world-size", str(world), "--parallel",
                       "pipeline", check=world == 4)
    _check_cut(data, world)
    layout = data["parallel"]
    assert layout["in_flight"] == world and layout["predicted_speedup"] >= 0.9 * world
    weights = data["components"]["transformer"]["weights_bytes"]
    single = _denoise_peaks(data)
    stage = next(s for s in data["stages"] if s["name"] == "denoise")
    for rank, peak in layout["per_rank_peak_bytes"].items():
        assert single[rank] <= peak <= 80 * GB
        # GPU r holds about 1/world of the weights (balanced by FLOPs: within half a share either way)
        assert 0.5 * weights / world < stage["breakdown"][rank]["weights"] < 1.5 * weights / world
    if world == 4:
        assert data["check"]["ran"] and not data["check"]["problems"]


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, fragment", [
    (("-m", "0=1GB,1=1GB,2=1GB", "--world-size", "3"), "needs a block per rank, and FluxTransformer2DModel has 2"),
    (("-m", "0=1GB,1=1GB", "--world-size", "1"), "--parallel pipeline needs --world-size 2 or more"),
    (("-m", "0=1GB,1=1GB", "--world-size", "2", "--in-flight", "0"), "--in-flight must be a whole number from 1"),
])
def test_bad_pipeline_requests_are_refused(args, fragment):
    code, _, err = run_dmap("plan", "tiny-flux", *args, "--parallel", "pipeline")
    _one_sentence_refusal(code, err, fragment)


def test_in_flight_without_pipeline_is_refused():
    code, _, err = run_dmap("plan", "tiny-sd3", "-m", "0=1GB,1=1GB", "--world-size", "2", "--parallel", "cfg",
                            "--in-flight", "2")
    _one_sentence_refusal(code, err, "--in-flight sets the micro-batches of --parallel pipeline")


@pytest.mark.parametrize("model, fragment", [
    ("sdxl", "not UNet2DConditionModel: use --parallel cfg"),
    ("sd3", "not SD3Transformer2DModel: use --parallel cfg"),
])
def test_denoisers_pipeline_parallel_cannot_cut_are_refused(model, fragment):
    code, _, err = run_dmap("plan", model, "-m", "0=80GB,1=80GB", "--world-size", "2", "--parallel", "pipeline")
    _one_sentence_refusal(code, err, fragment)


def test_a_denoiser_dmap_run_does_not_cut_is_refused_before_sizing():
    code, _, err = run_dmap("plan", "tiny-zimage", "-m", "0=1GB,1=1GB", "--world-size", "2", "--parallel", "pipeline")
    _one_sentence_refusal(code, err, "pipeline parallel cuts FluxTransformer2DModel", "not ZImageTransformer2DModel")


# --- the pure cut, memory and time model --------------------------------------------------------


def _shape(**changes):
    values = {"cls": "FluxTransformer2DModel", "heads": 24, "hidden": 3072, "layers": 57, "image_tokens": 4096,
              "text_tokens": 512, "batch": 1, "calls": 1, "element_bytes": 2, "prediction_bytes": 0}
    return DenoiserShape(**{**values, **changes})


@pytest.mark.parametrize("costs, parts", [
    ([5, 1, 1, 1, 1, 5], 2), ([3, 3, 3, 3, 3, 3, 3], 3), ([1, 9, 1, 1, 1, 1, 1, 9], 4), ([2, 7, 1, 8, 2, 8], 6),
    ([4, 4, 1], 1),
])
def test_balanced_cut_is_the_best_contiguous_cut(costs, parts):
    def largest(starts, head=0.0, tail=0.0):
        bounds = list(zip(starts, [*starts[1:], len(costs)]))
        sums = [sum(costs[a:b]) for a, b in bounds]
        sums[0] += head
        sums[-1] += tail
        return max(sums)

    for head, tail in ((0.0, 0.0), (3.0, 0.0), (0.0, 4.0)):
        starts = balanced_cut(costs, parts, head, tail)
        assert starts[0] == 0 and len(starts) == parts and all(a < b for a, b in zip(starts, starts[1:]))
        best = min(largest([0, *cut], head, tail) for cut in itertools.combinations(range(1, len(costs)), parts - 1))
        assert largest(starts, head, tail) == best


def test_pipeline_cut_of_a_flux_like_denoiser():
    """19 double blocks (about 2.4x a single block's parameters) and 38 single ones, embedders and output layers
    around them: every block once, slices contiguous, the largest at most the mean plus one block's FLOPs."""
    units = [Unit("x_embedder", ("x_embedder",), 100, 50), Unit("context_embedder", ("context_embedder",), 200, 100)]
    units += [Unit(f"transformer_blocks.{i}", (f"transformer_blocks.{i}",), 680, 340) for i in range(19)]
    units += [Unit(f"single_transformer_blocks.{i}", (f"single_transformer_blocks.{i}",), 282, 141) for i in range(38)]
    units += [Unit("norm_out", ("norm_out",), 40, 20), Unit("proj_out", ("proj_out",), 4, 2)]
    for world in (2, 3, 4, 8, 57):
        cut = pipeline_cut(units, world, _shape())
        assert isinstance(cut, PipelineCut) and cut.world_size == world
        assert [e for names in cut.slices for e in names] == [u.name for u in units if list_entry(u.name)]
        assert all(cut.slices) and set(cut.block_map) == {u.name for u in units}
        assert cut.block_map["x_embedder"] == 0 and cut.block_map["proj_out"] == world - 1
        mean = sum(cut.slice_flops) / world
        biggest = _shape().batch * (2 * 340 * 4608 + 4 * 4608**2 * 3072)
        assert max(cut.slice_flops) <= mean + biggest
        assert cut.shared_bytes == 100 + 200 + 40 + 4 and sum(cut.slice_bytes) == 19 * 680 + 38 * 282
    assert "needs a block per rank, and FluxTransformer2DModel has 57: use --world-size 57" in pipeline_cut(
        units, 58, _shape())
    assert "has none" in pipeline_cut(units[:2], 2, _shape())


def test_pipeline_memory_and_time_by_hand():
    cut = PipelineCut((("transformer_blocks.0",), ("transformer_blocks.1",)), {}, (10 * GB, 12 * GB),
                      (3e14, 1e14), 1 * GB)
    shape = _shape()
    hop = (4096 + 512) * 3072 * 2
    assert shape.hop_bytes == hop
    assert pipeline_rank_peak(cut, 1, 2 * GB, shape, 4, 600 * 10**6) == 12 * GB + GB + 2 * GB + 4 * 2 * hop + 6 * 10**8
    request = ParallelRequest(2, "pipeline", 100.0, 25.0)
    split, piped = pipeline_seconds(cut, shape, request, 4)
    assert split == pytest.approx(3 + 1 + hop / 25e9)  # the slices one after another, one hop
    assert piped == pytest.approx(3 + hop / 25e9)  # the slowest rank and its hop
    _, one = pipeline_seconds(cut, shape, request, 1)  # one prompt in flight: its round trip
    assert one == pytest.approx(3 + 1 + 2 * hop / 25e9)
