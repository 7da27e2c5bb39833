"""`dmap plan` end to end: exit codes, JSON contract, and the issue's acceptance scenarios."""

import json

import pytest
from conftest import run_dmap

from dm_cli.errors import DoesNotFitError, UsageError
from dm_cli.inputs import Generation, PlacementSpec
from dm_cli.model.skeleton import skeleton_for_component
from dm_cli.model.sources import resolve_source
from dm_cli.planning.make import make_plan
from dm_cli.planning.placement.blocks import coverage_problems
from dm_cli.planning.plan_file import load_plan, write_plan
from dm_cli.planning.plan_options import PlanOptions

GiB = 2**30


def assert_plan_contract(data, source):
    assert data["format"] == "dmap-plan" and data["version"] == 1
    for key in ("source", "dtype", "strategy", "mode", "devices", "inputs", "components", "stages"):
        assert key in data
    resolved = resolve_source(source)
    for name, comp in data["components"].items():
        skeleton, _ = skeleton_for_component(resolved.component(name))
        names = [t.name for t in skeleton.tensors] + [a for g in skeleton.tie_groups for a in g[1:]]
        assert coverage_problems(comp["device_map"], names) == [], name
    for stage in data["stages"]:
        for device, peak in stage["peak_bytes"].items():
            capacity = data["devices"][device]["capacity_bytes"]
            assert capacity is None or peak <= capacity, (stage["name"], device)


@pytest.mark.parametrize("spec", ["0=abc", "0=1GB,0=2GB", "0=-5GB", "0=1GB,disk=0", "gpu7=1GB"])
def test_bad_device_specs_exit_2(spec):
    code, out, err = run_dmap("plan", "tiny-sd15", "--max-memory", spec)
    assert code == 2, err
    assert err.startswith("Error:") and "Traceback" not in err


def test_bad_options_exit_2():
    assert run_dmap("plan", "tiny-sd15", "--max-memory", "0=1GB", "--strategy", "fastest")[0] == 2
    assert run_dmap("plan", "no-such-model", "--max-memory", "0=1GB")[0] == 2
    assert run_dmap("plan", "tiny-sd15", "--max-memory", "0=1GB", "--overhead", "5=1GB")[0] == 2


def test_plan_json_output_and_load(tmp_path):
    out = tmp_path / "plan.json"
    code, stdout, err = run_dmap("plan", "tiny-sd15", "--max-memory", "0=60KB,1=60KB,cpu=10MB", "--height", "64",
                                 "--overhead", "0=0,1=0", "--dtype", "fp32", "--json", "--output", out)
    assert code == 0, err
    data = json.loads(stdout)
    assert json.loads(out.read_text()) == data
    assert_plan_contract(data, "tiny-sd15")
    assert not list(tmp_path.glob(".*tmp"))  # written via temp + rename
    plan = load_plan(out)
    assert plan.to_json() == data
    with pytest.raises(UsageError):
        load_plan(tmp_path / "missing.json")


def test_human_output_renders(tmp_path):
    code, stdout, err = run_dmap("plan", "tiny-flux", "--max-memory", "0=400KB,1=400KB", "--height", "0",
                                 "--dtype", "fp32", "--mode", "staged")
    assert code == 0, err
    assert "│ denoise " in stdout and "hf_device_map" in stdout and "device_map" in stdout


def test_does_not_fit_exit_3_with_shortfall_and_nearest_change():
    code, out, err = run_dmap("plan", "tiny-sd15", "--max-memory", "0=30KB", "--height", "0", "--dtype", "fp32")
    assert code == 3
    assert "does not fit" in err and "more on GPU 0" in err and "cpu=" in err
    with pytest.raises(DoesNotFitError) as info:
        make_plan("tiny-sd15", PlanOptions(PlacementSpec("0=30KB", dtype="fp32"), generation=Generation(height=0, width=0)))
    assert info.value.details["shortfall_bytes"]["0"] > 0


def test_sdxl_unet_fp32_splits_on_6_and_10_gib():
    plan = make_plan("sdxl", PlanOptions(PlacementSpec("0=6GiB,1=10GiB", dtype="fp32"), component="unet"))
    unet = plan.components["unet"]
    assert set(unet.device_map.values()) == {0, 1} and unet.offloaded_bytes == 0
    assert plan.check["ran"] and plan.check["components"] == ["unet"] and plan.check["problems"] == []
    assert_plan_contract(plan.to_json(), "sdxl")
    # input-aware: activations were estimated and charged
    assert plan.activation_peaks["unet"] > 0
    assert sum(u.activations for s in plan.stages for u in s.use.values()) > 0


def test_sdxl_unet_on_5_and_5_gib_offloads_nothing_where_accelerate_offloads_6_5_gib():
    plan = make_plan("sdxl", PlanOptions(PlacementSpec("0=5GiB,1=5GiB,cpu=30GiB", dtype="fp32"), component="unet", generation=Generation(height=0, width=0), check=False))
    assert plan.offloaded_bytes == 0
    assert set(plan.components["unet"].device_map.values()) == {0, 1}

    import torch
    from accelerate import infer_auto_device_map

    from dm_cli.model.skeleton import build_on_meta

    comp = resolve_source("sdxl").component("unet")
    model = build_on_meta("diffusers", comp.cls, comp.config).to(torch.float32)
    device_map = infer_auto_device_map(model, max_memory={0: "5GiB", 1: "5GiB", "cpu": "30GiB"},
                                       no_split_module_classes=model._no_split_modules, dtype=torch.float32)
    sizes = {name: sum(p.numel() * 4 for p in module.parameters()) for name, module in model.named_modules()}
    offloaded = sum(sizes[name] for name, device in device_map.items() if device == "cpu")
    assert 6.0 * GiB < offloaded < 7.0 * GiB


def test_sdxl_unet_at_1024_explains_what_activations_cost():
    # weights alone (4.8 GB of up_blocks.0 the largest block) fit two 5 GiB GPUs; with the 1024x1024
    # activations and 600 MB of overhead per GPU they do not, and the plan says what that costs
    plan = make_plan("sdxl", PlanOptions(PlacementSpec("0=5GiB,1=5GiB,cpu=30GiB", dtype="fp32"), component="unet", check=False))
    assert plan.offloaded_bytes > 0
    explained = [w for w in plan.warnings if w.startswith("Weights alone would offload")]
    assert len(explained) == 1 and "activations for 1024x1024" in explained[0] and "GPU overhead" in explained[0], \
        plan.warnings


def test_flux_dev_bf16_on_two_16gb_gpus_at_1024_is_staged_with_no_offload():
    plan = make_plan("flux", PlanOptions(PlacementSpec("0=16GB,1=16GB", dtype="bf16"), generation=Generation(height=1024, width=1024)))
    assert plan.mode == "staged"
    assert plan.offloaded_bytes == 0
    assert plan.check["ran"] and plan.check["problems"] == []
    assert "transformer" in plan.check["components"]
    data = plan.to_json()
    assert_plan_contract(data, "flux")
    assert set(data["components"]["transformer"]["device_map"].values()) == {0, 1}
    assert data["components"]["vae"]["device_map"] in ({"": 0}, {"": 1})
    for stage in plan.stages:
        for key, use in stage.use.items():
            assert use.peak <= 16 * 10**9
            assert use.overhead == 600 * 10**6


def test_write_plan_is_atomic(tmp_path):
    plan = make_plan("tiny-sd15", PlanOptions(PlacementSpec("0=1MB", dtype="fp32"), generation=Generation(height=0, width=0), check=False))
    target = tmp_path / "p.json"
    write_plan(plan, target)
    assert json.loads(target.read_text())["components"]["unet"]["device_map"] == {"": 0}
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_does_not_fit_suggests_a_smaller_resolution():
    options = PlanOptions(PlacementSpec("0=1GB", dtype="fp32", overhead="0=0"), generation=Generation(height=768, width=768), check=False)
    fitting = make_plan("tiny-sd15", options)
    peak = max(max(s.peak_bytes.values()) for s in fitting.stages)
    with pytest.raises(DoesNotFitError) as info:
        make_plan("tiny-sd15", PlanOptions(PlacementSpec(f"0={peak}", dtype="fp32", overhead="0=0"), generation=Generation(height=1024, width=1024), check=False))
    assert "fits at 768x768" in str(info.value)
