"""The pure planner on hand-built inputs: no torch, no files."""

import pytest

from dm_cli.families.stages import default_stages
from dm_cli.planning.placement.blocks import (
    Block,
    ComponentInput,
    clean_device_map,
    component_blocks,
    coverage_problems,
)
from dm_cli.planning.placement.placement import NoFit
from dm_cli.planning.placement.search import Device, Stage, plan_pipeline

GB = 10**9


def chain(name, sizes, acts=None, splittable=True, peak=0, cls="Model"):
    acts = acts or [0] * len(sizes)
    blocks = [Block(f"blocks.{i}", int(s * GB), int(a * GB)) for i, (s, a) in enumerate(zip(sizes, acts))]
    return ComponentInput(name, cls, blocks, splittable, int(peak * GB))


def gpus(*sizes, cpu=None, overhead=0):
    devices = [Device(i, int(s * GB), int(overhead * GB)) for i, s in enumerate(sizes)]
    if cpu is not None:
        devices.append(Device("cpu", int(cpu * GB)))
    return devices


def one(comp, devices, **kw):
    return plan_pipeline([comp], [Stage("denoise", (comp.name,))], devices, **kw)


def assert_within_capacity(placement, devices):
    capacity = {d.name: d.capacity for d in devices}
    for stage in placement.stages:
        for key, peak in stage.peak_bytes.items():
            assert capacity[key] is None or peak <= capacity[key], (stage.name, key, peak)


def test_whole_component_on_one_gpu_when_it_fits():
    placement = one(chain("unet", [1, 1, 1]), gpus(4, 4))
    assert placement.components["unet"].device_map in ({"": 0}, {"": 1})
    assert placement.offloaded_bytes == 0 and placement.hops == 0


def test_split_is_contiguous_in_execution_order_and_covers_every_block():
    comp = chain("unet", [1] * 10)
    devices = gpus(6, 6)
    placement = one(comp, devices)
    device_map = placement.components["unet"].device_map
    assert list(device_map) == [b.name for b in comp.blocks]
    values = list(device_map.values())
    assert values == sorted(values) or values == sorted(values, reverse=True)  # one cut, no return
    assert placement.hops == 1 and placement.offloaded_bytes == 0
    assert_within_capacity(placement, devices)


def test_auto_balances_between_gpus():
    devices = gpus(8, 8)
    placement = one(chain("t", [1] * 10), devices)
    peaks = placement.stages[0].peak_bytes
    assert peaks["0"] == peaks["1"] == 5 * GB


def test_sequential_fills_gpu0_first():
    placement = one(chain("t", [1] * 10), gpus(8, 8), strategy="sequential")
    assert placement.stages[0].peak_bytes == {"0": 8 * GB, "1": 2 * GB}


def test_balanced_low_0_keeps_gpu0_light():
    placement = one(chain("t", [1] * 10), gpus(10, 10, 10), strategy="balanced_low_0")
    peaks = placement.stages[0].peak_bytes
    assert peaks.get("0", 0) == 0 and peaks["1"] == peaks["2"] == 5 * GB


def test_no_offload_reserve_when_nothing_is_offloaded():
    # accelerate would keep the largest block (3 GB) free on GPU 0 and offload; dmap uses all of it.
    comp = chain("unet", [3, 2, 2, 3])
    devices = gpus(5, 5, cpu=30)
    placement = one(comp, devices)
    assert placement.offloaded_bytes == 0
    assert all(u.reserve == 0 for s in placement.stages for u in s.use.values())


def test_offload_charges_the_largest_offloaded_block_to_its_execution_gpu():
    comp = chain("unet", [2, 2, 2, 2, 1])
    devices = gpus(4, cpu=30)
    placement = one(comp, devices)
    placed = placement.components["unet"]
    use = placement.stages[0].use
    assert placed.offloaded_bytes > 0 and placed.execution_device == 0
    assert use["0"].reserve == max(b.bytes for b in comp.blocks if placed.device_map[b.name] == "cpu")
    assert use["0"].peak <= 4 * GB and use["cpu"].weights == placed.offloaded_bytes
    assert_within_capacity(placement, devices)


def test_disk_only_after_cpu_is_full():
    comp = chain("t", [2, 2, 2, 2])
    devices = gpus(4) + [Device("cpu", 2 * GB), Device("disk", None)]
    placement = one(comp, devices)
    device_map = placement.components["t"].device_map
    # GPU 0 keeps one block plus the 2 GB reserve for streaming; cpu takes what it can, disk the rest
    assert list(device_map.values()) == [0, "cpu", "disk", "disk"]


def test_activations_are_charged_where_blocks_run_and_overhead_per_gpu():
    comp = chain("t", [3, 3, 3, 3], acts=[0.5, 0.5, 2, 2])
    devices = gpus(9, 9, overhead=0.6)
    placement = one(comp, devices)
    use = placement.stages[0].use
    for key, entry in use.items():
        runs = [b for b in comp.blocks if placement.components["t"].device_map[b.name] == int(key)]
        assert entry.activations == max(b.activation for b in runs)
        assert entry.overhead == int(0.6 * GB)
    assert_within_capacity(placement, devices)


def test_activation_peak_of_a_whole_component():
    placement = one(chain("vae", [1], splittable=False, peak=3), gpus(8))
    assert placement.stages[0].use["0"].activations == 3 * GB


def test_vae_is_never_split():
    vae = chain("vae", [1, 1, 1], splittable=False)
    devices = gpus(2, 2, cpu=10)
    placement = one(vae, devices)
    assert placement.components["vae"].device_map == {"": "cpu"}


def test_staged_peak_is_the_largest_stage_and_resident_adds_up():
    text = chain("text_encoder", [6])
    den = chain("transformer", [6])
    vae = chain("vae", [1], splittable=False)
    stages = [Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)), Stage("decode", ("vae",))]
    devices = gpus(8)
    placement = plan_pipeline([text, den, vae], stages, devices, mode="auto")
    assert placement.mode == "staged" and placement.offloaded_bytes == 0
    assert max(max(s.peak_bytes.values()) for s in placement.stages) == 6 * GB
    resident = plan_pipeline([text, den, vae], stages, gpus(16), mode="auto")
    assert resident.mode == "resident"
    assert all(s.use["0"].weights == 13 * GB for s in resident.stages)


def test_does_not_fit_without_cpu():
    with pytest.raises(NoFit):
        one(chain("t", [3, 3, 3]), gpus(4, 4))


def test_auto_minimises_offload_before_hops():
    # 3 GPUs: everything fits with 2 hops; a single-hop plan would have to offload.
    comp = chain("t", [3] * 6)
    devices = gpus(6, 6, 6, cpu=100)
    placement = one(comp, devices)
    assert placement.offloaded_bytes == 0 and placement.hops == 2


def test_default_stages_follow_the_offload_sequence():
    seq = "text_encoder->text_encoder_2->image_encoder->transformer->vae".split("->")
    stages = default_stages(["vae", "transformer", "text_encoder_2", "text_encoder"], seq)
    assert [(s.name, s.components) for s in stages] == [
        ("encode", ("text_encoder", "text_encoder_2")), ("denoise", ("transformer",)), ("decode", ("vae",))]


def test_component_blocks_order_and_coverage():
    modules = [("", "Net"), ("down", "Down"), ("down.0", "Res"), ("up", "Up"), ("mid", "Mid"), ("mid.conv", "Conv"),
               ("conv_in", "Conv")]
    tensors = [("down.0.weight", 10), ("up.w", 20), ("up.b", 1), ("mid.conv.weight", 5), ("conv_in.weight", 2),
               ("scale", 1)]
    order = ["conv_in", "down.0", "mid.conv", "up"]
    blocks, warnings = component_blocks(modules, tensors, ["Up"], order, [], {"mid.conv": 7, "up": 9})
    assert [b.name for b in blocks] == ["scale", "conv_in", "down.0", "mid.conv", "up"]
    assert [b.bytes for b in blocks] == [1, 2, 10, 5, 21]
    assert blocks[-1].activation == 9 and blocks[-2].activation == 7
    device_map = {b.name: 0 for b in blocks}
    assert coverage_problems(device_map, [t for t, _ in tensors]) == []
    assert coverage_problems({"up": 0, "up.w": 1}, ["up.w", "up.b"]) == ["up.w is covered by 2 entries (up, up.w)"]
    assert "never ran" in component_blocks(modules, tensors, [], ["conv_in"], [], {})[1][0]


def test_unsplittable_from_the_trace_becomes_one_block():
    modules = [("", "Net"), ("a", "A"), ("a.x", "L"), ("a.y", "L")]
    tensors = [("a.x.w", 1), ("a.y.w", 1)]
    assert [b.name for b in component_blocks(modules, tensors, [], None, [])[0]] == ["a.x", "a.y"]
    assert [b.name for b in component_blocks(modules, tensors, [], None, ["a"])[0]] == ["a"]


def test_clean_device_map_collapses_siblings():
    device_map = {"a.0": 0, "a.1": 0, "b.0": 1, "b.1": 0}
    assert clean_device_map(device_map, ["a", "a.0", "a.1", "b", "b.0", "b.1"]) == {"a": 0, "b.0": 1, "b.1": 0}
    assert clean_device_map({"a.0": 1, "a.1": 1}, ["a", "a.0", "a.1"]) == {"": 1}


def test_tied_alias_gets_a_key_on_its_kept_tensors_block():
    modules = [("", "T5"), ("shared", "Embedding"), ("encoder", "Stack"), ("encoder.block", "List"),
               ("encoder.block.0", "T5Block")]
    tensors = [("shared.weight", 100), ("encoder.block.0.w", 10)]
    blocks, _ = component_blocks(modules, tensors, ["T5Block"], None, [], None, None,
                                 [["shared.weight", "encoder.embed_tokens.weight"]])
    assert blocks[0].keys == ("shared", "encoder.embed_tokens")
    device_map = {k: 0 for b in blocks for k in b.keys}
    assert coverage_problems(device_map, ["shared.weight", "encoder.embed_tokens.weight", "encoder.block.0.w"]) == []


def test_children_a_split_parent_combines_stay_on_one_device():
    modules = [("", "UNet"), ("time_embedding", "T"), ("time_embedding.l1", "L"), ("time_embedding.l2", "L"),
               ("add_embedding", "T"), ("add_embedding.l1", "L"), ("conv_in", "Conv")]
    tensors = [("time_embedding.l1.w", 1), ("time_embedding.l2.w", 1), ("add_embedding.l1.w", 1), ("conv_in.w", 1)]
    order = ["time_embedding.l1", "time_embedding.l2", "add_embedding.l1", "conv_in"]
    blocks, _ = component_blocks(modules, tensors, [], order, [], None,
                                 {"": [["time_embedding", "add_embedding"]]})
    assert [b.keys for b in blocks] == [("time_embedding.l1", "time_embedding.l2", "add_embedding.l1"), ("conv_in",)]
    assert blocks[0].bytes == 3
    placement = one(ComponentInput("unet", "UNet", blocks), [Device(0, 3), Device(1, 3)])
    device_map = placement.components["unet"].device_map
    assert list(device_map) == ["time_embedding.l1", "time_embedding.l2", "add_embedding.l1", "conv_in"]
    assert len({device_map[k] for k in blocks[0].keys}) == 1


def test_auto_keeps_a_big_late_block_on_gpu_and_offloads_small_ones():
    # the last GPU cannot take the 3 GB block after the small ones; auto may offload the small ones instead
    comp = chain("t", [3, 1, 1, 3])
    devices = gpus(4, 4, cpu=100)
    placement = one(comp, devices)
    sequential = one(comp, devices, strategy="sequential")
    assert placement.offloaded_bytes <= sequential.offloaded_bytes
    assert_within_capacity(placement, devices)


def test_runs_on_cpu_when_activations_fit_no_gpu():
    comp = chain("unet", [1, 1], acts=[5, 5])
    devices = gpus(4, cpu=20)
    placement = one(comp, devices)
    assert placement.components["unet"].device_map == {"": "cpu"}
    assert placement.stages[0].use["cpu"].activations == 5 * GB
    assert any("runs on the cpu" in w for w in placement.warnings)


from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    acts=st.lists(st.integers(0, 10), min_size=12, max_size=12),
    gpu_sizes=st.lists(st.integers(5, 80), min_size=1, max_size=3),
    cpu=st.one_of(st.none(), st.integers(0, 200)),
    strategy=st.sampled_from(["auto", "sequential", "balanced", "balanced_low_0"]),
)
def test_any_plan_stays_within_capacity_covers_every_block_and_is_contiguous(sizes, acts, gpu_sizes, cpu, strategy):
    comp = ComponentInput("m", "M", [Block(f"b.{i}", s, a) for i, (s, a) in enumerate(zip(sizes, acts))])
    devices = [Device(i, g, 2) for i, g in enumerate(gpu_sizes)]
    if cpu is not None:
        devices.append(Device("cpu", cpu))
    try:
        placement = one(comp, devices, strategy=strategy)
    except NoFit:
        placement = None
    # a drawn case may not fit: hypothesis draws others until 60 examples were checked (fits and no-fits
    # by construction are tests/planning/test_planner_search.py's properties)
    assume(placement is not None)
    assert_within_capacity(placement, devices)
    device_map = placement.components["m"].device_map
    if list(device_map) != [""]:
        assert list(device_map) == [b.name for b in comp.blocks]
        gpu_runs = [d for d in device_map.values() if isinstance(d, int)]
        seen = []
        for device in gpu_runs:
            if seen and device != seen[-1]:
                assert device not in seen, device_map  # never returns to an earlier GPU
            if not seen or device != seen[-1]:
                seen.append(device)
    offloaded = sum(b.bytes for b in comp.blocks if device_map.get(b.name, device_map.get("")) == "cpu")
    assert placement.offloaded_bytes == offloaded


def test_consecutive_denoisers_form_one_exclusive_denoise_stage():
    stages = default_stages(["text_encoder", "transformer", "transformer_2", "vae"],
                            ["text_encoder", "transformer", "transformer_2", "vae"], ("transformer", "transformer_2"))
    assert [(s.name, s.components, s.exclusive) for s in stages] == [
        ("encode", ("text_encoder",), False), ("denoise", ("transformer", "transformer_2"), True),
        ("decode", ("vae",), False)]
    single = default_stages(["text_encoder", "transformer", "vae"], ["text_encoder", "transformer", "vae"])
    assert not single[1].exclusive


def _experts(devices, mode="auto"):
    comps = [chain("text_encoder", [3]), chain("transformer", [1] * 10, [0.5] * 10),
             chain("transformer_2", [1] * 10, [0.5] * 10), chain("vae", [0.2], [0.3], splittable=False)]
    stages = default_stages([c.name for c in comps], [c.name for c in comps], ("transformer", "transformer_2"))
    return plan_pipeline(comps, stages, devices, mode=mode)


def test_experts_stay_resident_together_when_they_fit():
    placement = _experts(gpus(12, 12))
    denoise = [s for s in placement.stages if s.name == "denoise"]
    assert len(denoise) == 1 and denoise[0].components == ["transformer", "transformer_2"]
    assert "together" in denoise[0].note and placement.offloaded_bytes == 0


def test_experts_that_do_not_fit_together_are_consecutive_stages_peaking_at_one_expert():
    devices = gpus(6, 6)  # 20 GB of experts on 12 GB: one expert (10 GB) + activations at a time
    placement = _experts(devices)
    assert placement.mode == "staged" and placement.offloaded_bytes == 0
    denoise = [s for s in placement.stages if s.name == "denoise"]
    assert [s.components for s in denoise] == [["transformer"], ["transformer_2"]]
    assert "before transformer_2 loads" in denoise[0].note and "after transformer is freed" in denoise[1].note
    for stage in denoise:  # the larger expert plus its activations, never the sum of both
        assert sum(u.weights for u in stage.use.values()) == 10 * GB
        assert all(u.activations == int(0.5 * GB) for u in stage.use.values())
    assert any("one at a time" in w for w in placement.warnings)
    assert_within_capacity(placement, devices)
    with pytest.raises(NoFit):
        _experts(devices, mode="resident")
