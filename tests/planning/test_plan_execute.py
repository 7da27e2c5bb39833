"""The split check bites: a map that splits a module whose forward combines its children is reported, per family.

For every pipeline family (dm_cli/families, so families added later are covered) the denoiser of its
tiny twin gets a deliberately bad map (a no-split block cut between its children: the block adds or
gates tensors from both sides of the cut) and a good one (the same cut moved to the block's end).
Both are checked on the meta device and during a real CPU forward under VirtualDevices with
accelerate's hooks attached: the bad map must be reported, naming the block, and the good one not.
The planner's own split plans of the tiny pipelines must then report nothing in the same harness.
"""

import json

import pytest

torch = pytest.importorskip("torch")

from conftest import PRESETS  # noqa: E402

from dm_cli.families import (  # noqa: E402
    all_families,
    call_spec,  # noqa: E402
    family_for,
)
from dm_cli.families.calls import TensorSpec  # noqa: E402
from dm_cli.inputs import Generation, InputSpec, PlacementSpec  # noqa: E402
from dm_cli.model.skeleton import skeleton_for_component  # noqa: E402
from dm_cli.model.sources import resolve_source  # noqa: E402
from dm_cli.planning.make import make_plan  # noqa: E402
from dm_cli.planning.placement.blocks import component_blocks  # noqa: E402
from dm_cli.planning.placement.components import prepare_component  # noqa: E402
from dm_cli.planning.plan_options import PlanOptions  # noqa: E402

INPUTS = InputSpec(64, 64)
# a video family's default length (LTX-2: 121 frames, its 1024 text tokens) makes a real CPU forward under the
# virtual devices take minutes for nothing the check needs: a few frames and a short prompt cut the same blocks
VIDEO_INPUTS = InputSpec(64, 64, num_frames=9, max_sequence_length=32)


def inputs_for(pipeline_class) -> InputSpec:
    family = family_for(pipeline_class)
    return VIDEO_INPUTS if family is not None and family.default_num_frames else INPUTS


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
    spec = call_spec(comp, pipeline_class, inputs_for(pipeline_class))
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


CASES = [("tiny-sd15", "unet"), ("tiny-sdxl", "unet"), ("tiny-flux", "transformer"), ("tiny-sd3", "transformer"),
         ("tiny-flux", "text_encoder_2")]


def run_under_virtual_devices(comp, pipeline_class, device_map) -> list[str]:
    """A real CPU forward (random weights) with accelerate's hooks at every entry and every virtual
    device mapped to the CPU, as `dmap run --simulate` runs: the problems VirtualDevices saw."""
    from accelerate import dispatch_model

    from dm_cli.planning.trace.trace import VirtualDevices

    model = build_random(comp)
    method, kwargs = make_inputs(comp, pipeline_class)
    dispatch_model(model, device_map=dict.fromkeys(device_map, "cpu"), main_device="cpu", force_hooks=True)
    with torch.no_grad(), VirtualDevices(model, device_map) as virtual:
        getattr(model, method)(**kwargs) if method != "forward" else model(**kwargs)
    return virtual.problems


def tiny_twin(family):
    """The bundled tiny pipeline of a family (each family needs one to be tested)."""
    for folder in sorted(PRESETS.glob("tiny-*")):
        index = json.loads((folder / "model_index.json").read_text())
        if family_for(index["_class_name"]) is family:
            return folder.name
    return None


def cut_maps(comp, pipeline_class):
    """(target block, bad map, good map), from the model's own no-split classes.

    The target is the first block, in execution order, of a class the model declares no-split with at
    least two leaves (modules holding tensors, or a module's own tensors). Bad, at leaf granularity:
    the target's first leaf on device 0, its other leaves on device 1, everything else on 0. Good, at the granularity of the
    model's top-level parts (its root children, with ModuleLists opened into their items): the parts
    up to the one holding the target on 0, the parts after it on 1.
    """
    from dm_cli.planning.trace.trace import trace_component

    skeleton, _ = skeleton_for_component(comp)
    trace = trace_component(comp, pipeline_class, inputs_for(pipeline_class), "fp32")
    order = trace.execution_order
    # children whose outputs the root's own forward joins (Z-Image's refiners, its embedders; LTX-2's time_embed
    # and its weightless norm_out): the root has no hook to move them, so neither map cuts there (the planner keeps
    # each such group on one device too, and gives a weightless one a key there)
    joined = {p for group in trace.same_device_groups.get("", []) for p in group if p}
    leaves, _ = component_blocks(skeleton.modules, [(t.name, t.bytes_at("float32")) for t in skeleton.tensors], [],
                                 order)
    classes = dict(skeleton.modules)

    # finest keys: a module's own tensors by name when it also has children with tensors (Wan's
    # blocks hold a scale_shift_table beside their layers), else the module holding them
    names = [t.name for t in skeleton.tensors]
    owners = [n.rpartition(".")[0] for n in names]
    mixed = {o for o in owners if any(other.startswith(o + ".") for other in owners)}
    keys = list(dict.fromkeys(n if o in mixed else o for n, o in zip(names, owners)))

    def inside(prefix):
        return [k for k in keys if k.startswith(prefix + ".")]

    ancestors = [".".join(b.name.split(".")[:n]) for b in leaves for n in range(1, b.name.count(".") + 2)]
    target = next(p for p in ancestors if classes.get(p) in skeleton.no_split_modules and len(inside(p)) >= 2
                  and p not in joined)
    first, *rest = inside(target)

    def part(name):
        head, _, tail = name.partition(".")
        return f"{head}.{tail.split('.')[0]}" if classes.get(head) == "ModuleList" and tail else head

    # outside the target's part, whole parts: their hooks move what the cut target hands on (a block's
    # residual add is not hooked at leaf granularity), so only the target is reported
    bad = {(k if part(k) == part(target) else part(k)): (1 if k in rest else 0) for k in keys}
    parts = list(dict.fromkeys(part(b.name) for b in leaves))  # in execution order
    cut = max([parts.index(part(target))] + [i for i, name in enumerate(parts) if name in joined])
    good = {name: (0 if i <= cut else 1) for i, name in enumerate(parts)}
    # joined modules without tensors (LTX-2's norm_out, whose output the root modulates with its own table) get a
    # key beside the root's tensors, as the planner gives them: their hook moves the last block's output back
    good.update({name: 0 for name in joined if name not in good and name in classes and not inside(name)
                 and name not in keys})
    assert 0 < len(parts) - 1 - cut, "the good map must split"
    return target, bad, good


def reported(problems, target, label) -> bool:
    """The target block, or a module inside it that the cut splits (Z-Image's first leaf sits in its attention), is
    named, and every problem is inside the target (nothing else was cut)."""
    return any(p.startswith((label, target + ".")) for p in problems) and all(
        p.startswith((target + " (", target + ".")) for p in problems)


@pytest.mark.parametrize("family", all_families(), ids=lambda f: f.name)
def test_split_check_reports_a_block_cut_between_its_children_and_passes_a_cut_between_blocks(family):
    from dm_cli.planning.trace.trace import check_device_map

    preset = tiny_twin(family)
    assert preset is not None, f"family {family.name} has no tiny-* preset: its split check cannot be tested"
    source = resolve_source(preset)
    comp = source.component(family.denoiser)
    target, bad, good = cut_maps(comp, source.pipeline_class)
    label = f"{target} ({dict(skeleton_for_component(comp)[0].modules)[target]}) combines tensors on devices"

    on_meta = check_device_map(comp, source.pipeline_class, inputs_for(source.pipeline_class), "float32", bad)
    assert reported(on_meta, target, label), on_meta
    assert check_device_map(comp, source.pipeline_class, inputs_for(source.pipeline_class), "float32", good) == []

    on_cpu = run_under_virtual_devices(comp, source.pipeline_class, bad)
    assert reported(on_cpu, target, label), on_cpu
    assert run_under_virtual_devices(comp, source.pipeline_class, good) == []


@pytest.mark.parametrize("preset,name", CASES)
def test_tiny_split_plan_passes_the_check_on_meta_and_on_cpu(preset, name):
    source = resolve_source(preset)
    comp = source.component(name)
    prepared = prepare_component(comp, source.pipeline_class, INPUTS, "float32").spec
    blocks = prepared.blocks
    weights = sum(b.bytes for b in blocks)
    share = max(int(max(b.bytes for b in blocks) * 1.05), weights // 3)  # < weights: must split
    assert share < weights
    activations = max(b.activation for b in blocks)
    spec = ",".join(f"{i}={(share + activations) // 1000 + 1}KB" for i in range(4))
    options = PlanOptions(PlacementSpec(spec, dtype="fp32", overhead="0=0,1=0,2=0,3=0"), component=name,
                          generation=Generation(height=INPUTS.height, width=INPUTS.width), check=True)
    plan = make_plan(preset, options)
    placed = plan.components[name]
    assert len(set(placed.device_map.values())) >= 2, placed.device_map
    assert placed.offloaded_bytes == 0
    assert plan.check["ran"] and plan.check["problems"] == []

    assert run_under_virtual_devices(comp, source.pipeline_class, placed.device_map) == []


def test_bad_map_splitting_an_sdxl_up_block_is_caught():
    from dm_cli.planning.trace.trace import VirtualDevices, check_device_map

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
