"""Meta-device tracing: execution order, activation estimates, unsplittable modules, split checks."""

import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dm_cli.families import call_spec  # noqa: E402
from dm_cli.inputs import InputSpec  # noqa: E402
from dm_cli.model.sources import ComponentSource, resolve_source  # noqa: E402
from dm_cli.planning.trace.trace import ComponentTrace, VirtualDevices, check_device_map, trace_component  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import measure_activations  # noqa: E402

SMALL = InputSpec(64, 64)


@pytest.fixture(autouse=True)
def _one_thread():
    """Real CPU forwards on a shared 2-core machine: one thread avoids oversubscription stalls."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def component(preset, name):
    source = resolve_source(preset)
    return source.component(name), source.pipeline_class


def first_index(order, prefix):
    return next(i for i, name in enumerate(order) if name == prefix or name.startswith(prefix + "."))


# A map of the tiny SDXL UNet by top-level module, `up_blocks.0` spread over its children.
TOP = ["conv_in", "time_proj", "time_embedding", "add_time_proj", "add_embedding", "down_blocks.0", "down_blocks.1",
       "mid_block", "up_blocks.0", "up_blocks.1", "conv_norm_out", "conv_act", "conv_out"]
GOOD_MAP = {name: (0 if i < 6 else 1) for i, name in enumerate(TOP)}  # split between the two down blocks
BAD_MAP = {name: 0 for name in TOP if name != "up_blocks.0"}
BAD_MAP.update({"up_blocks.0.resnets.0": 0, "up_blocks.0.attentions.0": 1, "up_blocks.0.resnets.1": 1,
                "up_blocks.0.attentions.1": 1, "up_blocks.0.resnets.2": 1, "up_blocks.0.attentions.2": 1,
                "up_blocks.0.upsamplers.0": 1})


@pytest.mark.parametrize("preset", ["tiny-sd15", "tiny-sdxl"])
def test_unet_execution_order_runs_mid_block_before_up_blocks(preset):
    comp, pipeline = component(preset, "unet")
    trace = trace_component(comp, pipeline, SMALL, "fp32")
    order = trace.execution_order
    assert trace.fallback_warning is None
    assert first_index(order, "mid_block") < first_index(order, "up_blocks")
    assert first_index(order, "down_blocks") < first_index(order, "mid_block")
    assert order[-1] == "conv_out"
    # registration order, what accelerate walks, has the up blocks first
    from dm_cli.model.skeleton import skeleton_for_component

    registered = [prefix for prefix, _ in skeleton_for_component(comp)[0].modules]
    assert first_index(registered, "up_blocks") < first_index(registered, "mid_block")
    # every module holding tensors is listed exactly once
    holders = {t.name.rpartition(".")[0] for t in skeleton_for_component(comp)[0].tensors}
    assert sorted(order) == sorted(holders)


def test_flux_tiny_execution_order():
    comp, pipeline = component("tiny-flux", "transformer")
    order = trace_component(comp, pipeline, SMALL, "bf16").execution_order
    assert order[0] == "x_embedder"
    assert first_index(order, "context_embedder") < first_index(order, "transformer_blocks.0")
    assert first_index(order, "transformer_blocks.0") < first_index(order, "single_transformer_blocks.0")
    assert order[-2:] == ["norm_out.linear", "proj_out"]


def test_flux_tiny_work_outside_the_blocks_is_counted_apart():
    """The embedders and output layers (what every rank of a pipeline runs, whatever its slice): part of the call's
    ops and FLOPs, counted again apart."""
    comp, pipeline = component("tiny-flux", "transformer")
    work = trace_component(comp, pipeline, SMALL, "bf16").work
    assert 0 < work["outside_ops"] < work["ops"] / 2 and 0 < work["outside_flops"] < work["matmul_flops"] / 2
    assert 0 < work["outside_bytes"] < work["other_bytes"]


def test_vae_traces_decode_and_lists_the_unused_encoder_last():
    comp, pipeline = component("tiny-sdxl", "vae")
    trace = trace_component(comp, pipeline, SMALL, "fp32")
    order = trace.execution_order
    assert trace.inputs["method"] == "decode"
    assert first_index(order, "decoder") < first_index(order, "encoder")
    assert trace.module_peaks.get("decoder", 0) > 0
    assert "encoder" not in trace.module_peaks  # never ran
    assert trace.activation_peak > 0


@pytest.mark.parametrize("preset,name", [("tiny-flux", "text_encoder"), ("tiny-flux", "text_encoder_2"),
                                         ("tiny-sd3", "transformer"), ("tiny-sd3", "text_encoder_3")])
def test_other_families_trace(preset, name):
    comp, pipeline = component(preset, name)
    trace = trace_component(comp, pipeline, SMALL, "bf16")
    assert trace.fallback_warning is None
    assert trace.activation_peak > 0 and trace.execution_order


def test_t5_sequence_length_follows_the_pipeline():
    """512 T5 tokens unless told: FluxPipeline.__call__'s default for dev and schnell alike, as `dmap run` encodes."""
    dev, pipeline = component("flux", "text_encoder_2")
    schnell, pipeline_s = component("flux-schnell", "text_encoder_2")
    assert call_spec(dev, pipeline, SMALL).kwargs["input_ids"].shape == (1, 512)
    assert call_spec(schnell, pipeline_s, SMALL).kwargs["input_ids"].shape == (1, 512)
    assert call_spec(dev, pipeline, InputSpec(64, 64, max_sequence_length=128)).kwargs["input_ids"].shape == (1, 128)


def test_cfg_doubles_the_denoiser_batch_for_sd_and_sdxl_not_flux():
    for preset in ("tiny-sd15", "tiny-sdxl"):
        comp, pipeline = component(preset, "unet")
        doubled = trace_component(comp, pipeline, SMALL, "fp32")
        single = trace_component(comp, pipeline, InputSpec(64, 64, guidance_scale=1.0), "fp32")
        assert doubled.inputs["kwargs"]["sample"]["shape"][0] == 2
        assert single.inputs["kwargs"]["sample"]["shape"][0] == 1
        assert doubled.activation_peak > single.activation_peak
    comp, pipeline = component("tiny-flux", "transformer")
    assert call_spec(comp, pipeline, SMALL).kwargs["hidden_states"].shape[0] == 1


def test_sdxl_unet_gets_added_cond_kwargs():
    comp, pipeline = component("sdxl", "unet")
    kwargs = call_spec(comp, pipeline, InputSpec(1024, 1024)).kwargs
    assert kwargs["sample"].shape == (2, 4, 128, 128)
    assert kwargs["encoder_hidden_states"].shape == (2, 77, 2048)
    assert kwargs["added_cond_kwargs"]["text_embeds"].shape == (2, 1280)
    assert kwargs["added_cond_kwargs"]["time_ids"].shape == (2, 6)


def test_activation_estimate_grows_with_resolution_and_batch():
    comp, pipeline = component("tiny-sd15", "unet")
    small = trace_component(comp, pipeline, InputSpec(64, 64), "fp32").activation_peak
    large = trace_component(comp, pipeline, InputSpec(128, 128), "fp32").activation_peak
    batched = trace_component(comp, pipeline, InputSpec(64, 64, batch_size=2, num_images=2), "fp32").activation_peak
    assert large > 3 * small
    assert batched > 3 * small
    half = trace_component(comp, pipeline, InputSpec(64, 64), "bf16").activation_peak
    assert half < small


def test_weights_only_gives_order_and_zero_activations():
    comp, pipeline = component("tiny-sdxl", "unet")
    weights_only = trace_component(comp, pipeline, InputSpec(0, 0), "fp32")
    with_inputs = trace_component(comp, pipeline, SMALL, "fp32")
    assert weights_only.activation_peak == 0
    assert set(weights_only.module_peaks.values()) == {0}
    assert weights_only.execution_order == with_inputs.execution_order


def test_unsplittable_finds_blocks_that_combine_children():
    comp, pipeline = component("tiny-sdxl", "unet")
    trace = trace_component(comp, pipeline, SMALL, "fp32")
    # the up blocks concatenate skip connections with their children's outputs
    assert "up_blocks.0" in trace.unsplittable and "up_blocks.1" in trace.unsplittable
    assert "down_blocks.0.resnets.0" in trace.unsplittable  # residual add of its input and conv2's output
    # down blocks and the mid block only chain their children: accelerate's hooks can split them
    assert "down_blocks.0" not in trace.unsplittable and "mid_block" not in trace.unsplittable
    assert "" not in trace.unsplittable
    assert ["add_embedding", "time_embedding"] in trace.same_device_groups[""]


def test_check_device_map_catches_a_split_up_block_and_passes_a_block_split():
    comp, pipeline = component("tiny-sdxl", "unet")
    assert check_device_map(comp, pipeline, SMALL, "fp32", GOOD_MAP) == []
    problems = check_device_map(comp, pipeline, SMALL, "fp32", BAD_MAP)
    assert problems == ["up_blocks.0 (CrossAttnUpBlock2D) combines tensors on devices 0 and 1 in aten.cat"]
    offloaded = dict(GOOD_MAP, **{"up_blocks.1": "cpu", "conv_out": "disk"})  # run on the main device
    assert check_device_map(comp, pipeline, SMALL, "fp32", offloaded) == []
    partial = check_device_map(comp, pipeline, SMALL, "fp32", {"conv_in": 0, "down_blocks": 1})
    assert any("places no entry" in p for p in partial)


def test_check_device_map_flux_split_between_blocks_passes():
    comp, pipeline = component("tiny-flux", "transformer")
    trace = trace_component(comp, pipeline, SMALL, "bf16")
    tops = []
    for prefix in trace.execution_order:
        top = ".".join(prefix.split(".")[:2]) if prefix.split(".")[0].endswith("blocks") else prefix.split(".")[0]
        if top not in tops:
            tops.append(top)
    half = len(tops) // 2
    device_map = {top: (0 if i < half else 1) for i, top in enumerate(tops)}
    assert check_device_map(comp, pipeline, SMALL, "bf16", device_map) == []


def _tiny_sdxl_unet():
    from diffusers import UNet2DConditionModel

    comp, _ = component("tiny-sdxl", "unet")
    torch.manual_seed(0)
    model = UNet2DConditionModel.from_config(comp.config).eval()
    args = (torch.randn(2, 4, 16, 16), torch.tensor(10.0))
    kwargs = {"encoder_hidden_states": torch.randn(2, 77, 64), "return_dict": False,
              "added_cond_kwargs": {"text_embeds": torch.randn(2, 32), "time_ids": torch.randn(2, 6)}}
    return model, args, kwargs


def test_virtual_devices_on_cpu_is_bitwise_identical_and_reports_bad_maps():
    model, args, kwargs = _tiny_sdxl_unet()
    with torch.no_grad():
        reference = model(*args, **kwargs)[0]
        with VirtualDevices(model, BAD_MAP) as bad:
            out_bad = model(*args, **kwargs)[0]
        with VirtualDevices(model, GOOD_MAP) as good:
            out_good = model(*args, **kwargs)[0]
        after = model(*args, **kwargs)[0]
    assert torch.equal(reference, out_bad) and torch.equal(reference, out_good) and torch.equal(reference, after)
    assert bad.problems == ["up_blocks.0 (CrossAttnUpBlock2D) combines tensors on devices 0 and 1 in aten.cat"]
    assert good.problems == []
    assert not any(hasattr(p, "_dmap_tag") for p in model.parameters())  # nothing left behind
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_virtual_devices_can_be_entered_once_per_forward():
    model, args, kwargs = _tiny_sdxl_unet()
    checker = VirtualDevices(model, BAD_MAP)
    with torch.no_grad():
        for _ in range(2):
            with checker:
                model(*args, **kwargs)
    assert checker.problems == ["up_blocks.0 (CrossAttnUpBlock2D) combines tensors on devices 0 and 1 in aten.cat"]
    partial = VirtualDevices(model, {"conv_in": 0, "down_blocks": 1})
    with torch.no_grad(), partial:
        model(*args, **kwargs)
    assert "places no entry for 290 tensors" in partial.problems[0]


def test_virtual_devices_agrees_with_accelerate_dispatch_on_cpu():
    """Under accelerate's own hooks (every device mapped to the CPU) the check sees the same problem."""
    from accelerate.hooks import attach_align_device_hook_on_blocks, remove_hook_from_submodules

    model, args, kwargs = _tiny_sdxl_unet()
    with torch.no_grad():
        reference = model(*args, **kwargs)[0]
        attach_align_device_hook_on_blocks(model, execution_device=dict.fromkeys(list(BAD_MAP) + [""], "cpu"),
                                           offload=dict.fromkeys(list(BAD_MAP) + [""], False))
        try:
            with VirtualDevices(model, BAD_MAP) as bad:
                out = model(*args, **kwargs)[0]
        finally:
            remove_hook_from_submodules(model)
    assert torch.equal(reference, out)
    assert bad.problems == ["up_blocks.0 (CrossAttnUpBlock2D) combines tensors on devices 0 and 1 in aten.cat"]


def test_trace_is_cached_and_round_trips_json(tmp_path, monkeypatch):
    monkeypatch.setenv("DMAP_CACHE_DIR", str(tmp_path))
    comp, pipeline = component("tiny-sd15", "unet")
    first = trace_component(comp, pipeline, SMALL, "fp32")
    assert list((tmp_path / "traces").glob("*.json"))
    second = trace_component(comp, pipeline, SMALL, "fp32")
    assert second.seconds == 0.0
    assert second.execution_order == first.execution_order and second.activation_peak == first.activation_peak
    assert ComponentTrace.from_json(first.to_json()).to_json() == first.to_json()
    other = trace_component(comp, pipeline, InputSpec(128, 128), "fp32")
    assert other.activation_peak != first.activation_peak


def test_generic_fallback_and_registration_order_warning():
    # no pipeline knowledge: arguments from the forward signature (sample, timestep)
    unet2d = ComponentSource("unet", "diffusers", "UNet2DModel",
                             {"_class_name": "UNet2DModel", "block_out_channels": [4, 8], "norm_num_groups": 2,
                              "down_block_types": ["DownBlock2D", "DownBlock2D"],
                              "up_block_types": ["UpBlock2D", "UpBlock2D"], "sample_size": 8}, None, None)
    trace = trace_component(unet2d, None, SMALL, "fp32")
    assert trace.fallback_warning is None and trace.activation_peak > 0
    assert first_index(trace.execution_order, "mid_block") < first_index(trace.execution_order, "up_blocks")
    # a forward that needs arguments dmap cannot invent: registration order and a warning
    prior = ComponentSource("prior", "diffusers", "PriorTransformer",
                            {"_class_name": "PriorTransformer", "num_attention_heads": 2, "attention_head_dim": 4,
                             "num_layers": 1, "embedding_dim": 8, "num_embeddings": 4, "additional_embeddings": 2},
                            None, None)
    trace = trace_component(prior, None, SMALL, "fp32")
    assert trace.fallback_warning and "registration order" in trace.fallback_warning
    assert trace.execution_order and trace.activation_peak == 0


def test_activation_estimate_matches_a_cpu_measurement():
    """The meta estimate is within ±20% of the CPU allocator's peak (reduced SD 1.5 UNet, batch 2)."""
    config = measure_activations.reduced_unet_config((32, 64, 64, 64), cross_attention_dim=64)
    measured = measure_activations.measured_peak(config, 128)
    estimated = measure_activations.estimated_peak(config, 128)
    assert measured > 1_000_000
    assert 0.8 <= estimated / measured <= 1.2, (estimated, measured)


def test_real_flux_transformer_traces_at_1024():
    comp, pipeline = component("flux", "transformer")
    start = time.perf_counter()
    trace = trace_component(comp, pipeline, InputSpec(1024, 1024), "bf16", use_cache=False)
    elapsed = time.perf_counter() - start
    print(f"flux transformer trace at 1024²: {elapsed:.1f} s, activation peak {trace.activation_peak / 1e9:.2f} GB")
    assert trace.fallback_warning is None
    assert trace.inputs["kwargs"]["hidden_states"]["shape"] == [1, 4096, 64]
    assert trace.inputs["kwargs"]["encoder_hidden_states"]["shape"] == [1, 512, 4096]
    assert first_index(trace.execution_order, "transformer_blocks.18") < first_index(
        trace.execution_order, "single_transformer_blocks.0")
    # activations: more than one block's hidden states, far less than the n² attention would take
    assert 0.1e9 < trace.activation_peak < 2e9
    assert "transformer_blocks.0" in trace.unsplittable
    assert elapsed < 120
