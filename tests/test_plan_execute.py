"""Split plans of the tiny pipelines run for real on CPU: accelerate hooks at every block, virtual devices.

Each plan must split (budgets in KB). The component is dispatched with accelerate (every virtual
device mapped to the CPU, hooks forced) and run under the tracer's VirtualDevices: no op may mix
two virtual devices, and the output must be bitwise equal to the unsplit model's.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

from dm_cli.inputs import InputSpec  # noqa: E402
from dm_cli.pipelines import TensorSpec, call_spec  # noqa: E402
from dm_cli.plan import PlanOptions, make_plan, prepare_component  # noqa: E402
from dm_cli.planner import component_blocks  # noqa: E402
from dm_cli.skeleton import skeleton_for_component  # noqa: E402
from dm_cli.sources import resolve_source  # noqa: E402

INPUTS = InputSpec(64, 64)


def build_random(comp):
    torch.manual_seed(0)
    if comp.library == "diffusers":
        import diffusers

        model = getattr(diffusers, comp.cls).from_config(comp.config)
    else:
        import transformers

        cls = getattr(transformers, comp.cls)
        clean = {k: v for k, v in comp.config.items() if k not in ("_name_or_path", "transformers_version")}
        model = cls(cls.config_class.from_dict(clean))
    return model.eval().float()


def make_inputs(comp, pipeline_class):
    spec = call_spec(comp, pipeline_class, INPUTS)
    generator = torch.Generator().manual_seed(1)

    def make(value):
        if isinstance(value, TensorSpec):
            if value.kind == "long":
                return torch.randint(0, 50, value.shape, generator=generator)
            return torch.randn(value.shape, generator=generator)
        if isinstance(value, dict):
            return {k: make(v) for k, v in value.items()}
        return value

    return spec.method, make(spec.kwargs)


def first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    return first_tensor(output[0])


CASES = [("tiny-sd15", "unet"), ("tiny-sdxl", "unet"), ("tiny-flux", "transformer"), ("tiny-sd3", "transformer"),
         ("tiny-flux", "text_encoder_2")]


@pytest.mark.parametrize("preset,name", CASES)
def test_tiny_split_plan_runs_bitwise_equal(preset, name):
    from accelerate import dispatch_model

    from dm_cli.trace import VirtualDevices

    source = resolve_source(preset)
    comp = source.component(name)
    prepared = prepare_component(comp, source.pipeline_class, INPUTS, "float32").spec
    blocks = prepared.blocks
    weights = sum(b.bytes for b in blocks)
    share = max(int(max(b.bytes for b in blocks) * 1.05), weights // 3)  # < weights: must split
    assert share < weights
    activations = max(b.activation for b in blocks)
    spec = ",".join(f"{i}={(share + activations) // 1000 + 1}KB" for i in range(4))
    options = PlanOptions(max_memory=spec, component=name, dtype="fp32", inputs=INPUTS, check=True,
                          overhead="0=0,1=0,2=0,3=0")
    plan = make_plan(preset, options)
    placed = plan.components[name]
    assert len(set(placed.device_map.values())) >= 2, placed.device_map
    assert placed.offloaded_bytes == 0
    assert plan.check["ran"] and plan.check["problems"] == []

    model = build_random(comp)
    method, kwargs = make_inputs(comp, source.pipeline_class)
    with torch.no_grad():
        expected = first_tensor(getattr(model, method)(**kwargs) if method != "forward" else model(**kwargs))
    split = copy.deepcopy(model)
    dispatch_model(split, device_map={k: "cpu" for k in placed.device_map}, main_device="cpu", force_hooks=True)
    with torch.no_grad(), VirtualDevices(split, placed.device_map) as virtual:
        got = first_tensor(split(**kwargs) if method == "forward" else getattr(split, method)(**kwargs))
    assert virtual.problems == []
    assert torch.equal(got, expected)


def test_bad_map_splitting_an_sdxl_up_block_is_caught():
    from dm_cli.trace import VirtualDevices, check_device_map

    source = resolve_source("tiny-sdxl")
    comp = source.component("unet")
    skeleton, _ = skeleton_for_component(comp)
    # leaves as blocks (no no-split classes): then cut inside up_blocks.0, between its resnets
    blocks, _ = component_blocks(skeleton.modules, [(t.name, t.bytes_at("float32")) for t in skeleton.tensors], [])
    device_map = {}
    for block in blocks:
        inside_tail = block.name.startswith("up_blocks.0.") and not block.name.startswith("up_blocks.0.resnets.0")
        later = block.name.startswith(("up_blocks.1", "conv_norm_out", "conv_out"))
        device_map[block.name] = 1 if inside_tail or later else 0
    problems = check_device_map(comp, source.pipeline_class, INPUTS, "float32", device_map)
    assert problems, "splitting CrossAttnUpBlock2D across devices must be reported"
    assert any("up_blocks.0" in p for p in problems), problems

    model = build_random(comp)
    _, kwargs = make_inputs(comp, source.pipeline_class)
    with torch.no_grad(), VirtualDevices(model, device_map) as virtual:
        model(**kwargs)
    assert virtual.problems
