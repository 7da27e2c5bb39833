"""The planner's search, pinned by cases worked out by hand and by cases built around a known placement.

Each hand-made case below has one placement that fits (or one best one), derived in its docstring;
it fails when the part of the search it names is taken out (`scripts/mutation_planner.py` applies
those mutants and runs this file). The properties build cases around a placement known to fit (the
planner must do at least as well) or cases that cannot fit (the planner must say NoFit).
"""

import pytest
from hypothesis import given, settings, strategies as st

from dm_cli.planner import Block, ComponentInput, Device, NoFit, Stage, plan_pipeline

GB = 10**9


def whole(name, size, splittable=True):
    """A component made of one block of `size` GB."""
    return ComponentInput(name, "Model", [Block(name, int(size * GB))], splittable)


def chain(name, sizes):
    return ComponentInput(name, "Model", [Block(f"blocks.{i}", int(s * GB)) for i, s in enumerate(sizes)])


def devices(*sizes, cpu=None):
    found = [Device(i, int(s * GB)) for i, s in enumerate(sizes)]
    if cpu is not None:
        found.append(Device("cpu", int(cpu * GB)))
    return found


def resident(comps, devs, **kw):
    """All components loaded together (one stage, resident mode)."""
    return plan_pipeline(comps, [Stage("run", tuple(c.name for c in comps))], devs, mode="resident", **kw)


def maps(placement):
    return {name: comp.device_map for name, comp in placement.components.items()}


def assert_within_capacity(placement, devs):
    capacity = {d.name: d.capacity for d in devs}
    for stage in placement.stages:
        for key, peak in stage.peak_bytes.items():
            assert capacity[key] is None or peak <= capacity[key], (stage.name, key, peak)


# --- hand-made cases ---------------------------------------------------------------------------------


def test_a_block_that_misses_the_last_gpu_is_offloaded_alone_and_later_blocks_return():
    """Kills `no-skip-fill`. One 4 GB GPU, a cpu, blocks of 2, 3 and 1 GB (no activations).

    Offloading streams the largest offloaded block through the GPU, so the GPU keeps its blocks plus
    that reserve. Keeping the 3 GB block: the 2 GB or the 1 GB block must go (reserve ≥ 1 GB) and
    3 + 1 + 2 = 6 or 3 + 2 + 1 = 6 > 4, so the 3 GB block is offloaded and reserves 3 GB. What is left
    (1 GB) holds only the 1 GB block: blocks.0 and blocks.1 on the cpu (5 GB), blocks.2 on GPU 0.
    A fill that stops at the first block missing the GPU puts everything after it on the cpu too,
    which cannot pay for the reserve: all 6 GB end on the cpu.
    """
    devs = devices(4, cpu=100)
    placement = resident([chain("unet", [2, 3, 1])], devs)
    assert maps(placement) == {"unet": {"blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": 0}}
    assert placement.offloaded_bytes == 5 * GB
    use = placement.stages[0].use["0"]
    assert (use.weights, use.reserve, use.peak) == (1 * GB, 3 * GB, 4 * GB)


def test_components_are_packed_largest_first():
    """Kills `no-largest-first`. Two 10 GB GPUs, no cpu, components of 4, 4, 6 and 6 GB loaded together.

    20 GB in 20 GB: both GPUs end exactly full, and 4 + 4 = 8 or 6 + 6 = 12 leave one short or over,
    so each GPU holds one 4 GB and one 6 GB component. In execution order the two 4 GB components go
    to one GPU first and no GPU then has room for the second 6 GB one: no fit.
    """
    devs = devices(10, 10)
    comps = [whole("a", 4), whole("b", 4), whole("c", 6), whole("d", 6)]
    placement = resident(comps, devs)
    placed = maps(placement)
    assert all(len(m) == 1 and "" in m for m in placed.values()), placed  # nothing split
    on = {gpu: sorted(n for n, m in placed.items() if m[""] == gpu) for gpu in (0, 1)}
    assert sorted(map(tuple, on.values())) == [("a", "c"), ("b", "d")] or \
        sorted(map(tuple, on.values())) == [("a", "d"), ("b", "c")], on
    assert placement.stages[0].peak_bytes == {"0": 10 * GB, "1": 10 * GB}


def test_gpu_order_is_searched_not_taken_from_the_indices():
    """Kills `no-gpu-permutations` and `gpu-order-and-reverse-only`.

    GPUs 0, 1, 2 of 3, 8 and 3 GB, no cpu; one component of blocks 6, 2, 3, 3 GB in execution order.
    The 6 GB block fits GPU 1 only; with the 2 GB block it fills GPU 1 (8), and each 3 GB block then
    needs a small GPU of its own. A split is contiguous in execution order, so the fill must start
    on GPU 1: in index order (0, 1, 2) and in reverse (2, 1, 0) a 3 GB block is left with no GPU.
    """
    placement = resident([chain("t", [6, 2, 3, 3])], devices(3, 8, 3))
    device_map = maps(placement)["t"]
    assert device_map["blocks.0"] == device_map["blocks.1"] == 1
    assert {device_map["blocks.2"], device_map["blocks.3"]} == {0, 2}
    assert placement.offloaded_bytes == 0 and placement.hops == 2


def test_the_bigger_gpu_first_and_the_most_even_cut():
    """Kills `no-gpu-permutations` and `no-balanced-refinement`.

    GPU 0 of 4 GB, GPU 1 of 8 GB; blocks 6, 1, 1, 1, 1 GB. The 6 GB block fits GPU 1 only, so GPU 1
    runs first and GPU 0 takes the tail. Cuts after blocks.0, .1, .2 give GPU 1 / GPU 0 shares of
    6/4 (100% of GPU 0), 7/3 (88% / 75%) and 8/2 (100% of GPU 1): the most even is after blocks.1.
    """
    placement = resident([chain("t", [6, 1, 1, 1, 1])], devices(4, 8))
    assert maps(placement)["t"] == {"blocks.0": 1, "blocks.1": 1, "blocks.2": 0, "blocks.3": 0, "blocks.4": 0}
    assert placement.stages[0].peak_bytes == {"1": 7 * GB, "0": 3 * GB}


def test_a_whole_component_goes_where_it_fits_best():
    """Kills `first-fit` (and `worst-fit`). GPU 0 of 9 GB, GPU 1 of 5 GB, no cpu; loaded together in
    this order: a (1 GB, not splittable), b (6 GB, not splittable), c (blocks of 3 and 4 GB).

    14 GB in 14 GB. b fits GPU 0 only; c (7 GB) then fits no GPU whole, so it splits, contiguous in
    execution order: 3 GB beside b (GPU 0 full at 9) and 4 GB on GPU 1; a fills GPU 1 (5). The first
    GPU with room for a is whichever comes first in the order tried; putting it there takes the room
    that one of c's blocks needs, in either GPU order.
    """
    comps = [whole("a", 1, splittable=False), whole("b", 6, splittable=False), chain("c", [3, 4])]
    placement = resident(comps, devices(9, 5))
    assert maps(placement) == {"a": {"": 1}, "b": {"": 0}, "c": {"blocks.0": 0, "blocks.1": 1}}
    assert placement.stages[0].peak_bytes == {"0": 9 * GB, "1": 5 * GB}


# --- properties: cases built around a placement known to fit, and cases that cannot fit ---------------


@st.composite
def known_placements(draw, gpu_order_by_index=False):
    """One component and devices built around a placement that fits.

    The placement: contiguous runs of blocks on some GPUs (in a drawn order, each GPU at most once),
    then optionally a tail of blocks on the cpu. Each used GPU's capacity is exactly what the planner's
    model charges it (weights, the largest activation of the blocks that run there, overhead; the GPU
    that runs first also streams the tail: its largest block as reserve, its activations) plus drawn
    slack; unused GPUs get any capacity. Returns (component, devices, offloaded bytes of the placement).
    """
    n_gpus = draw(st.integers(1, 4))
    if gpu_order_by_index:
        order = list(range(draw(st.integers(1, n_gpus))))
    else:
        order = draw(st.permutations(range(n_gpus)))[:draw(st.integers(1, n_gpus))]
    block = st.tuples(st.integers(1, 9), st.integers(0, 4))  # (bytes, activation)
    runs = {gpu: draw(st.lists(block, min_size=1, max_size=3)) for gpu in order}
    with_cpu = draw(st.booleans())
    tail = draw(st.lists(block, max_size=3)) if with_cpu else []
    overhead = draw(st.integers(0, 2))
    capacities = {}
    for gpu in range(n_gpus):
        if gpu not in runs:
            capacities[gpu] = draw(st.integers(0, 12))
            continue
        charged = list(runs[gpu]) + (tail if gpu == order[0] else [])
        reserve = max((b for b, _ in tail), default=0) if gpu == order[0] else 0
        need = sum(b for b, _ in runs[gpu]) + reserve + max(a for _, a in charged) + overhead
        capacities[gpu] = need + draw(st.sampled_from([0, 0, 1, 3]))
    offloaded = sum(b for b, _ in tail)
    devs = [Device(gpu, capacities[gpu], overhead) for gpu in range(n_gpus)]
    if with_cpu:
        devs.append(Device("cpu", offloaded + draw(st.integers(0, 5))))
    blocks = [run for gpu in order for run in runs[gpu]] + tail
    comp = ComponentInput("m", "M", [Block(f"b.{i}", b, a) for i, (b, a) in enumerate(blocks)])
    return comp, devs, offloaded


def one(comp, devs, **kw):
    return plan_pipeline([comp], [Stage("denoise", (comp.name,))], devs, **kw)


def assert_contiguous_and_covering(placement, comp):
    device_map = placement.components[comp.name].device_map
    if list(device_map) != [""]:
        assert list(device_map) == [b.name for b in comp.blocks]
        seen = []
        for device in (d for d in device_map.values() if isinstance(d, int)):
            if seen and device != seen[-1]:
                assert device not in seen, device_map  # never returns to an earlier GPU
            if not seen or device != seen[-1]:
                seen.append(device)
    off = sum(b.bytes for b in comp.blocks if device_map.get(b.name, device_map.get("")) in ("cpu", "disk"))
    assert placement.offloaded_bytes == off


@settings(max_examples=80, deadline=None)
@given(case=known_placements())
def test_auto_offloads_no_more_than_a_known_placement(case):
    comp, devs, known_offload = case
    placement = one(comp, devs)  # NoFit here fails the test: a placement exists
    assert placement.offloaded_bytes <= known_offload
    assert_within_capacity(placement, devs)
    assert_contiguous_and_covering(placement, comp)


@settings(max_examples=60, deadline=None)
@given(case=known_placements(gpu_order_by_index=True),
       strategy=st.sampled_from(["auto", "sequential", "balanced"]))
def test_every_strategy_fits_a_case_that_fits_in_gpu_order(case, strategy):
    """The accelerate-like strategies fill GPUs in index order: a placement in that order must be found."""
    comp, devs, _ = case
    placement = one(comp, devs, strategy=strategy)
    assert_within_capacity(placement, devs)
    assert_contiguous_and_covering(placement, comp)


@st.composite
def impossible_cases(draw):
    """Devices too small by construction: more weights than all capacity, or a block no GPU can hold."""
    n_gpus = draw(st.integers(1, 3))
    overhead = draw(st.integers(0, 2))
    capacities = draw(st.lists(st.integers(overhead, 20), min_size=n_gpus, max_size=n_gpus))
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=8))
    devs = [Device(i, c, overhead) for i, c in enumerate(capacities)]
    kind = draw(st.sampled_from(["weights", "block"]))
    if kind == "weights":  # every device, cpu included, full before the last byte
        room = sum(c - overhead for c in capacities)
        cpu = draw(st.one_of(st.none(), st.integers(0, 10)))
        if cpu is not None:
            devs.append(Device("cpu", cpu))
            room += cpu
        if sum(sizes) <= room:
            sizes.append(room - sum(sizes) + 1)
    else:  # no cpu, and one block (with its activation) larger than every GPU's room
        big = max(capacities) - overhead + 1
        sizes.insert(draw(st.integers(0, len(sizes))), big)
    comp = ComponentInput("m", "M", [Block(f"b.{i}", s) for i, s in enumerate(sizes)])
    return comp, devs


@settings(max_examples=60, deadline=None)
@given(case=impossible_cases(), strategy=st.sampled_from(["auto", "sequential", "balanced", "balanced_low_0"]))
def test_a_case_that_cannot_fit_is_no_fit(case, strategy):
    comp, devs = case
    with pytest.raises(NoFit):
        one(comp, devs, strategy=strategy)
