"""`dmap plan --world-size N --parallel ...`: CFG-parallel and context parallel layouts (dm_cli/planning/parallel/parallel.py).

Config-only presets, no weights; the two traced plans (FLUX.2 [dev], Wan 2.2 at a small size) run once each
and are shared, the refusals come before any trace.
"""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
from conftest import run_dmap

from dm_cli.errors import UsageError
from dm_cli.planning.parallel.parallel import (
    CP_PLANS,
    Candidate,
    DenoiserLoad,
    DenoiserShape,
    Guidance,
    ParallelRequest,
    candidates,
    context_refusal,
    guidance_branches,
    step_seconds,
)

GB = 10**9
FOUR = "0=80GB,1=80GB,2=80GB,3=80GB"
EIGHT = ",".join(f"{i}=80GB" for i in range(8))
WAN_SMALL = ("--height", "256", "--width", "448", "--frames", "5")  # 2 latent frames x 16 x 28 = 896 tokens


def _plan(tmp_path_factory, *args):
    """(plan JSON, the tables at 200 columns) of one `dmap plan` (no split check: not what is tested here)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    code, out, err = run_dmap("plan", *args, "--no-check", "-o", path, env={"COLUMNS": "200"})
    assert code == 0, err
    return json.loads(path.read_text()), out


@pytest.fixture(scope="module")
def flux2_auto(tmp_path_factory):
    return _plan(tmp_path_factory, "flux2", "-m", FOUR, "--world-size", "4")


@pytest.fixture(scope="module")
def wan_both(tmp_path_factory):
    return _plan(tmp_path_factory, "wan2.2", "-m", EIGHT, *WAN_SMALL, "--world-size", "8", "--parallel", "cfg+context")


def _one_sentence_refusal(code, err, *fragments):
    assert code == 2, err
    message = err.strip().splitlines()[-1]
    assert message.startswith("Error: ") and message.endswith(".")
    assert len(re.findall(r"[.:] [A-Z]", message[7:])) == 0, message  # one sentence
    for fragment in fragments:
        assert fragment in message, message


def test_flux2_context_parallel_over_four_ranks(flux2_auto, tmp_path_factory):
    data, _ = _plan(tmp_path_factory, "flux2", "-m", FOUR, "--world-size", "4", "--parallel", "context")
    layout = data["parallel"]
    assert (layout["world_size"], layout["layout"], layout["cfg"], layout["ulysses"], layout["ring"]) == (
        4, "context", 1, 4, 1)
    weights = data["components"]["transformer"]["weights_bytes"]
    activations = data["components"]["transformer"]["activation_peak_bytes"]
    for rank in "0123":  # the whole transformer on every rank, a quarter of its activations, 600 MB overhead
        peak = layout["per_rank_peak_bytes"][rank]
        assert weights + activations // 4 + 600 * 10**6 <= peak < weights + activations // 2 + 600 * 10**6
        assert peak <= 80 * GB
    assert layout["predicted_step_s"]["context"] < layout["predicted_step_s"]["split"]
    assert data["mode"] == "staged"  # each rank loads the denoiser once the text encoder is freed
    assert layout == flux2_auto[0]["parallel"] | {"predicted_step_s": layout["predicted_step_s"],
                                                "rejected": layout["rejected"], "reason": layout["reason"]}


def test_flux2_auto_picks_context_and_says_why(flux2_auto):
    layout = flux2_auto[0]["parallel"]
    assert layout["layout"] == "context" and layout["ulysses"] == 4
    assert set(layout["predicted_step_s"]) == {"split", "context", "pipeline"}  # pipeline: per image-step in a queue
    assert "guidance-distilled" in layout["rejected"]["cfg+context"]
    assert "layouts that share every step when one fits (context does here)" in layout["rejected"]["pipeline"]
    assert re.match(r"context parallel \(Ulysses 4\), the fastest layout that fits: predicted [\d.]+ s/step against "
                    r"[\d.]+ s/step split; fits with [\d.]+ GB per rank at most$", layout["reason"]), layout["reason"]


def test_flux2_render_shows_layout_ranks_and_reason(flux2_auto):
    data, out = flux2_auto
    assert "Parallel: context parallel (Ulysses 4), world size 4 = cfg 1 x ulysses 4 x ring 1" in out
    assert "the fastest layout that fits" in out and "--device-tflops" in out and "--link-gbps" in out
    peak = f"{data['parallel']['per_rank_peak_bytes']['3'] / GB:.2f} GB"
    assert re.search(rf"3\s.*GPU 3\s.*{re.escape(peak)}", out), out


def test_wan_eight_ranks_two_cfg_by_four_ulysses(wan_both):
    data, out = wan_both
    layout = data["parallel"]
    assert (layout["cfg"], layout["ulysses"], layout["world_size"]) == (2, 4, 8)
    experts = sum(data["components"][name]["weights_bytes"] for name in ("transformer", "transformer_2"))
    peaks = layout["per_rank_peak_bytes"]
    assert sorted(peaks, key=int) == [str(r) for r in range(8)]
    assert all(experts < peak <= 80 * GB for peak in peaks.values()) and layout["experts"] == "together"
    assert "world size 8 = cfg 2 x ulysses 4 x ring 1" in out
    assert re.search(r"7\s.*GPU 7\s.*GB", out) and "CFG-parallel 2 x context parallel (Ulysses 4), as asked" in out


def test_ulysses_degree_that_does_not_divide_the_heads_is_refused():
    spec = ",".join(f"{i}=80GB" for i in range(5))
    code, _, err = run_dmap("plan", "flux2", "-m", spec, "--world-size", "5", "--parallel", "context")
    _one_sentence_refusal(code, err, "Ulysses degree 5 does not divide Flux2Transformer2DModel's 48 attention heads")


def test_cfg_refused_for_guidance_distilled_flux1():
    code, _, err = run_dmap("plan", "flux", "-m", "0=80GB,1=80GB", "--world-size", "2", "--parallel", "cfg")
    _one_sentence_refusal(code, err, "guidance-distilled", "--parallel context")


def test_cfg_refused_for_qwen_image_without_a_negative_prompt():
    code, _, err = run_dmap("plan", "qwen-image", "-m", "0=80GB,1=80GB", "--world-size", "2", "--parallel", "cfg")
    _one_sentence_refusal(code, err, "--negative-prompt")
    from dm_cli.families import family_for
    from dm_cli.inputs import InputSpec

    qwen = family_for("QwenImagePipeline")
    assert guidance_branches(qwen, InputSpec(), "", {}).branches == 2  # an empty negative prompt runs true CFG
    assert guidance_branches(qwen, InputSpec(), "", {"true_cfg_scale": 1.0}).branches == 1
    sd3 = family_for("StableDiffusion3Pipeline")
    assert guidance_branches(sd3, InputSpec(), None, {}).branches == 2
    assert guidance_branches(sd3, InputSpec(guidance_scale=1.0), None, {}).branches == 1


def test_world_size_beyond_the_gpus_listed_is_refused():
    code, _, err = run_dmap("plan", "flux2", "-m", "0=80GB,1=80GB,cpu=64GB", "--world-size", "4")
    _one_sentence_refusal(code, err, "--world-size 4", "2 GPU(s)", "GPU 2")


@pytest.mark.parametrize("args, fragment", [
    (("--world-size", "0"), "--world-size must be"),
    (("--parallel", "cfg"), "needs --world-size 2"),
    (("--world-size", "2", "--parallel", "none"), "would run one process"),
    (("--world-size", "2", "--parallel", "tensor"), "--parallel must be"),
    (("--world-size", "2", "--link-gbps", "0"), "--link-gbps must be"),
    (("--world-size", "2", "--mode", "resident"), "--mode staged"),
])
def test_bad_parallel_requests_are_refused_before_tracing(args, fragment):
    code, _, err = run_dmap("plan", "tiny-flux2", "-m", "0=1GB,1=1GB", *args)
    _one_sentence_refusal(code, err, fragment)


def test_world_size_one_is_todays_plan(tmp_path):
    before, after = tmp_path / "a.json", tmp_path / "b.json"
    assert run_dmap("plan", "tiny-flux2", "-m", "0=1GB,1=1GB", "-q", "-o", before)[0] == 0
    assert run_dmap("plan", "tiny-flux2", "-m", "0=1GB,1=1GB", "-q", "-o", after, "--world-size", "1",
                    "--parallel", "none")[0] == 0
    assert before.read_bytes() == after.read_bytes() and b'"parallel"' not in before.read_bytes()


def _tiny_parallel_plan(tmp_path) -> Path:
    path = tmp_path / "plan.json"
    code, _, err = run_dmap("plan", "tiny-flux2", "-m", "0=1GB,1=1GB", "-q", "-o", path, "--world-size", "2",
                            "--parallel", "context")
    assert code == 0, err
    return path


def test_a_parallel_plan_reads_back(tmp_path):
    from dm_cli.planning.plan_file import load_plan

    path = _tiny_parallel_plan(tmp_path)
    written = json.loads(path.read_text())
    assert written["parallel"]["layout"] == "context" and written["version"] == 1
    assert load_plan(path).to_json() == written


@pytest.mark.parametrize("hostile", [
    [], {"world_size": True}, {"world_size": 2, "layout": "context", "cfg": 1, "ulysses": 3},
    {"layout": "tensor"}, {"cfg": 3}, {"ring": 2}, {"per_rank_peak_bytes": {"0": 1}},
    {"per_rank_peak_bytes": {"0": -1, "1": 2}}, {"predicted_step_s": {"context": -1}},
    {"predicted_step_s": {"warp": 1.0}}, {"reason": 7}, {"world_size": 4, "ulysses": 4,
                                                         "per_rank_peak_bytes": {str(r): 1 for r in range(4)}},
    {"link_gbps": 0}, {"experts": "all"},
])
def test_a_hostile_parallel_key_is_refused(tmp_path, hostile):
    from dm_cli.planning.plan_file import load_plan

    path = _tiny_parallel_plan(tmp_path)
    data = json.loads(path.read_text())
    data["parallel"] = hostile if not isinstance(hostile, dict) else {**data["parallel"], **hostile}
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=r"is not a dmap plan \(.*'parallel'.*\): write one") as caught:
        load_plan(path)
    assert caught.value.exit_code == 2 and str(caught.value).count(". ") == 0


def test_cp_plans_match_the_installed_diffusers():
    """CP_PLANS names exactly the classes whose diffusers source declares a `_cp_plan` (of those it lists)."""
    folder = Path(importlib.util.find_spec("diffusers").origin).parent / "models" / "transformers"
    declared = set()
    for source in folder.glob("*.py"):
        text = source.read_text()
        for match in re.finditer(r"^class (\w+)\(.*?(?=^class |\Z)", text, re.S | re.M):
            if "\n    _cp_plan = {" in match.group(0):
                declared.add(match.group(1))
    assert set(CP_PLANS) <= declared
    assert "SD3Transformer2DModel" not in declared and "ZImageTransformer2DModel" not in declared


def _shape(**changes):
    values = {"cls": "WanTransformer3DModel", "heads": 40, "hidden": 5120, "layers": 40, "image_tokens": 75600,
                  "text_tokens": 512, "batch": 1, "calls": 2, "element_bytes": 2, "prediction_bytes": 2 * 16 * 21 * 90 * 160}
    return DenoiserShape(**{**values, **changes})


def test_context_refusals_name_the_class_and_the_numbers():
    assert "SD3Transformer2DModel has no _cp_plan" in context_refusal(_shape(cls="SD3Transformer2DModel"), 2)
    assert "does not divide the 75601 image tokens" in context_refusal(_shape(image_tokens=75601), 4)
    assert context_refusal(_shape(), 8) is None
    found, refused = candidates(ParallelRequest(8, "auto"), Guidance("separate", 2), _shape())
    assert [c.layout for c in found] == ["split", "context", "cfg+context", "pipeline"] and set(refused) == {"cfg"}


def test_step_time_model_by_hand():
    """Wan 2.2 at 720x1280x81: FLOPs and all-to-all volume as the module's doc says, at 100 TFLOP/s and 25 GB/s."""
    shape, guidance = _shape(), Guidance("separate", 2)
    load = DenoiserLoad((28 * GB, 28 * GB), 8 * GB, 14 * 10**9)
    request = ParallelRequest(8, "auto", 100.0, 25.0)
    flops = 2 * (2 * 14e9 * 76112 + 4 * 40 * 75600 * 76112 * 5120)
    assert math.isclose(step_seconds(Candidate("split"), shape, guidance, load, request), flops / 1e14)
    all_to_all = 4 * (75600 / 4) * 5120 * 2 * 3 / 4 * 40 * 1  # Wan splits the video tokens; one call per rank
    both = flops / 8 / 1e14 + all_to_all / 25e9 + shape.prediction_bytes / 25e9
    assert math.isclose(step_seconds(Candidate("cfg+context", 2, 4), shape, guidance, load, request), both)


def test_auto_for_wan_720p_on_eight_gpus_is_two_cfg_by_four_ulysses():
    """Wan 2.2 at 720x1280x81 (75,600 video tokens; 8.6 GB of activations per call, as the trace says), pure."""
    from dm_cli.planning.parallel.parallel import Rank
    from dm_cli.planning.parallel.parallel_layout import choose_layout

    load = DenoiserLoad((28_636_399_744, 28_636_399_744), 8_623_095_106, 14_288_000_000, hops=1)
    ranks = [Rank(r, 80 * GB, 600 * 10**6, 12 * GB) for r in range(8)]
    layout = choose_layout(ParallelRequest(8, "auto"), Guidance("separate", 2), _shape(), load, ranks)
    assert (layout.layout, layout.cfg, layout.ulysses) == ("cfg+context", 2, 4)
    times = layout.predicted_step_s
    assert times["cfg+context"] < times["context"] < times["split"] / 6
    per_rank = 2 * 28_636_399_744 + -(-8_623_095_106 // 4) + 4 * 75600 // 4 * 5120 * 2 + 600 * 10**6
    assert layout.per_rank_peak_bytes == {str(r): per_rank for r in range(8)}
    tight = [Rank(r, 40 * GB, 600 * 10**6) for r in range(8)]  # one expert at a time, freed at the switch
    assert choose_layout(ParallelRequest(8, "cfg+context"), Guidance("separate", 2), _shape(), load,
                         tight).experts == "one at a time"


def test_auto_keeps_the_split_where_a_layout_is_predicted_less_than_ten_percent_faster():
    """A layout that shares the steps is worth its exchanges only where the prediction says it is clearly faster: on
    two CPU ranks context was predicted 1% faster than the split on the demo and measured 21% slower (the predictions
    of cfg and context came within about 20% of the measured steps). Within AUTO_MARGIN auto keeps the split and
    says why; beyond it, it shares."""
    from dm_cli.planning.parallel.parallel import Rank
    from dm_cli.planning.parallel.parallel_layout import AUTO_MARGIN, choose_layout

    shape, guidance = _shape(), Guidance("distilled", 1, "one branch")
    load = DenoiserLoad((28 * GB,), 8 * GB, 14 * 10**9, hops=1)
    ranks = [Rank(r, 80 * GB, 600 * 10**6) for r in range(2)]
    split = step_seconds(Candidate("split"), shape, guidance, load, ParallelRequest(2, "auto", 100.0, 25.0))
    bare = step_seconds(Candidate("context", 1, 2), shape, guidance, load, ParallelRequest(2, "auto", 100.0, 25.0))
    messages = (4 * shape.layers + 1) * shape.calls  # Ulysses' collectives a step, each paying the latency

    def auto(ratio: float):
        latency = (ratio * split - bare) / messages  # context predicted at `ratio` x the split
        return choose_layout(ParallelRequest(2, "auto", 100.0, 25.0, link_latency_s=latency), guidance, shape, load,
                             ranks)

    close = auto(0.95)
    assert close.layout == "split" and close.predicted_step_s["context"] < close.predicted_step_s["split"]
    assert "kept by auto: context parallel (Ulysses 2) is predicted at" in close.reason, close.reason
    assert f"less than {AUTO_MARGIN - 1:.0%} faster" in close.reason
    assert auto(0.85).layout == "context"
    asked = choose_layout(ParallelRequest(2, "context", 100.0, 25.0, link_latency_s=(0.95 * split - bare) / messages),
                          guidance, shape, load, ranks)
    assert asked.layout == "context"  # asked for: no margin
