"""The planner's search, pinned by cases worked out by hand and by cases built around a known placement.

Each hand-made case below has one placement that fits (or one best one), derived in its docstring;
it fails when the part of the search it names is taken out (`scripts/mutation_planner.py` applies
those mutants and runs this file). The properties build cases around a placement known to fit (the
planner must do at least as well) or cases that cannot fit (the planner must say NoFit).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner import assert_within_capacity

from dm_cli.planning.placement.blocks import Block, ComponentInput
from dm_cli.planning.placement.placement import NoFit
from dm_cli.planning.placement.search import Device, Stage, plan_pipeline

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
    assert placement.hops == 0  # offloaded blocks run on GPU 0: no device change
    use = placement.stages[0].use["0"]
    assert (use.weights, use.reserve, use.peak) == (1 * GB, 3 * GB, 4 * GB)


def test_the_last_gpu_skips_a_block_after_the_first_gpu_is_full():
    """Kills `skip-on-every-gpu` (and `no-skip-fill`). GPU 0 of 8 GB, GPU 1 of 2 GB, a cpu; blocks
    2, 6, 2, 4 GB; offloaded blocks stream through GPU 0, the first GPU of the split.

    14 GB do not fit 10. Keeping the 6 GB block on a GPU leaves at most 2 + 2 beside it and offloads
    the 4 GB one, whose reserve no GPU has room for; so it is offloaded and GPU 0 reserves 6 GB,
    keeping 2 GB of blocks. GPU 1 takes 2 GB: blocks.0 on GPU 0, blocks.2 on GPU 1, blocks.1 and
    blocks.3 (10 GB) on the cpu. A fill that offloads every block missing *any* GPU never reaches
    GPU 1 and offloads 12 GB.
    """
    placement = resident([chain("t", [2, 6, 2, 4])], devices(8, 2, cpu=100))
    assert maps(placement) == {"t": {"blocks.0": 0, "blocks.1": "cpu", "blocks.2": 1, "blocks.3": "cpu"}}
    assert placement.offloaded_bytes == 10 * GB
    assert placement.stages[0].peak_bytes == {"0": 8 * GB, "cpu": 10 * GB, "1": 2 * GB}


def test_the_reserve_refill_charges_overhead_and_activations():
    """Kills `refill-ignores-overflow` and `room-ignores-overhead`. GPU 0 of 10 GB with 1 GB of
    overhead, a cpu; blocks of 5, 4 and 1 GB with activations of 2, 0 and 2 GB.

    Offloaded blocks run on GPU 0, so it always holds the largest activation (2) and the overhead (1):
    7 GB are left for weights and the reserve. Keeping the 5 GB block needs at least 1 GB of reserve
    beside it and then 5 + 4 or 5 + 1 + 4: over. Keeping the 4 GB block reserves 5: over. So both go
    to the cpu (reserve 5) and GPU 0 keeps the 1 GB block: 1 + 5 + 2 + 1 = 9 GB, 9 GB offloaded.
    """
    devs = [Device(0, 10 * GB, 1 * GB), Device("cpu", 100 * GB)]
    comp = ComponentInput("t", "Model", [Block("blocks.0", 5 * GB, 2 * GB), Block("blocks.1", 4 * GB),
                                         Block("blocks.2", 1 * GB, 2 * GB)])
    placement = resident([comp], devs)
    assert maps(placement) == {"t": {"blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": 0}}
    use = placement.stages[0].use["0"]
    assert (use.weights, use.reserve, use.activations, use.overhead) == (1 * GB, 5 * GB, 2 * GB, 1 * GB)


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


def test_a_refill_moves_no_more_than_it_must():
    """Kills `refill-overshoots`. GPU 0 of 9 GB, a cpu; a (blocks of 4 and 3 GB, activations 0 and
    3 GB) and b (1 GB, activation 2 GB) loaded together.

    Everything on the GPU needs 8 + 3 = 11. a cannot stay in part: keeping 4 GB reserves 3 and runs
    the 3 GB activation there (4 + 3 + 3 = 10), keeping 3 GB reserves 4 (3 + 4 + 3 = 10). So a goes
    whole to the cpu (runs there) and b stays: 1 + 2 = 3 GB on the GPU, 7 GB offloaded. A reserve
    grown past what the first excess needs pushes b off too.
    """
    a = ComponentInput("a", "Model", [Block("blocks.0", 4 * GB), Block("blocks.1", 3 * GB, 3 * GB)])
    b = ComponentInput("b", "Model", [Block("b", 1 * GB, 2 * GB)])
    placement = resident([a, b], devices(9, cpu=100))
    assert maps(placement) == {"a": {"": "cpu"}, "b": {"": 0}}
    assert placement.offloaded_bytes == 7 * GB


def test_an_overshooting_refill_does_not_turn_a_fit_into_no_fit():
    """GPU 0 of 3 GB, 2 GB of cpu; three 1 GB blocks, the last with 1 GB of activations (charged on
    GPU 0 wherever that block lives). All three on the GPU need 4; two need 2 + 1 reserve + 1 = 4; one
    needs 1 + 1 + 1 = 3: one block stays, two (2 GB) fill the cpu exactly.
    """
    comp = ComponentInput("t", "Model", [Block("blocks.0", 1 * GB), Block("blocks.1", 1 * GB),
                                         Block("blocks.2", 1 * GB, 1 * GB)])
    placement = resident([comp], devices(3, cpu=2))
    assert placement.offloaded_bytes == 2 * GB
    assert list(maps(placement)["t"].values()).count(0) == 1
    assert placement.stages[0].peak_bytes == {"0": 3 * GB, "cpu": 2 * GB}


def test_a_refill_that_changes_nothing_grows_by_more_than_the_excess():
    """Kills `no-refill-scaling`. GPU 0 of 1000 MB, a cpu; blocks of 414, 295, 212 and 371 MB with
    activations 0, 54, 0 and 216 MB (offloaded blocks run on GPU 0: 216 MB is always there).

    1292 MB do not fit. Keeping blocks.0 reserves 371: 414 + 371 + 216 = 1001, 1 MB over; keeping
    blocks.3 reserves 414: 371 + 414 + 216 = 1001, over; two blocks are over by far. Keeping blocks.1
    reserves 414: 295 + 414 + 216 = 925 fits, 997 MB offloaded (blocks.2 alone would offload 1080).
    The fill that keeps blocks.0 is 1 MB over, and its reserve must grow by 79 MB before the fill
    changes: a refill that grows it by the 1 MB excess each round runs out of rounds, all on the cpu.
    """
    mb = 10**6
    sizes = [(414, 0), (295, 54), (212, 0), (371, 216)]
    comp = ComponentInput("t", "Model", [Block(f"blocks.{i}", w * mb, a * mb) for i, (w, a) in enumerate(sizes)])
    placement = resident([comp], [Device(0, 1000 * mb), Device("cpu", 100 * GB)])
    assert maps(placement) == {"t": {"blocks.0": "cpu", "blocks.1": 0, "blocks.2": "cpu", "blocks.3": "cpu"}}
    assert placement.offloaded_bytes == 997 * mb
    assert placement.stages[0].peak_bytes["0"] == 925 * mb


def test_components_loaded_together_fill_the_gpus_in_turn():
    """Kills `cursor-per-component`. GPU 0 of 4 GB, GPU 1 of 5 GB, a cpu; a (blocks of 2 and 5 GB) and
    b (1 and 5 GB) loaded together, in that order.

    13 GB do not fit 9. A 5 GB block fits GPU 1 only, so one component's 5 GB block goes there and
    the other's cannot (5 + 5 > 5, and offloading it reserves 5 GB on a GPU that has no room). a split
    2 | 5 fills GPU 0 with 2 and GPU 1 with 5; b whole on the cpu runs there, with no reserve: 6 GB
    offloaded. Starting b on GPU 0 again puts its 1 GB block beside a's and its 5 GB block's reserve
    with them, which does not fit.
    """
    placement = resident([chain("a", [2, 5]), chain("b", [1, 5])], devices(4, 5, cpu=100))
    assert maps(placement) == {"a": {"blocks.0": 0, "blocks.1": 1}, "b": {"": "cpu"}}
    assert placement.offloaded_bytes == 6 * GB


def test_a_whole_component_is_packed_with_its_forward_activation():
    """Kills `whole-activation-ignored`. GPU 0 of 6 GB, a cpu; a (2 GB, not splittable, forward peak
    4 GB) and b (blocks of 3 and 4 GB) loaded together.

    a on the GPU needs 2 + 4 = 6: all of it. b cannot join: half of it on the GPU reserves the other
    half there. So a on GPU 0, b whole on the cpu (runs there): 7 GB offloaded. Packing a by its
    weights alone lets b's blocks in beside it, and the plan that then fails pushes everything off.
    """
    a = ComponentInput("a", "Model", [Block("a", 2 * GB, 1 * GB)], splittable=False, activation_peak=4 * GB)
    placement = resident([a, chain("b", [3, 4])], devices(6, cpu=100))
    assert maps(placement) == {"a": {"": 0}, "b": {"": "cpu"}}
    assert placement.offloaded_bytes == 7 * GB
    assert placement.stages[0].use["0"].peak == 6 * GB


def test_a_split_that_fits_is_found_when_the_whole_component_does_not():
    """Kills `no-whole-peak-in-fill` (a bug the `room-ignores-overhead` mutant exposed). GPU 0 of 9 GB,
    GPU 1 of 2 GB, no cpu; blocks of 7 and 2 GB, no block activations, forward peak 4 GB.

    Whole on GPU 0 the component needs 9 + 4 = 13 GB. Split, each GPU holds only its blocks'
    activations (none): 7 on GPU 0 and 2 on GPU 1 fit exactly. A fill that lets the last block join
    the others on GPU 0 sees 9 GB of weights, the plan then fails by the 4 GB peak, and the refill
    charges it everywhere: no fit.
    """
    comp = ComponentInput("t", "Model", [Block("blocks.0", 7 * GB), Block("blocks.1", 2 * GB)],
                          activation_peak=4 * GB)
    placement = resident([comp], devices(9, 2))
    assert maps(placement) == {"t": {"blocks.0": 0, "blocks.1": 1}}
    assert placement.stages[0].peak_bytes == {"0": 7 * GB, "1": 2 * GB}


def test_components_loaded_together_take_turns_for_activations():
    """Kills `activations-add-up`. GPU 0 of 10 GB; a (4 GB) and b (3 GB) each need 3 GB of activations.

    Components loaded together run one after another: 4 + 3 + max(3, 3) = 10 fits, both on GPU 0.
    """
    a = ComponentInput("a", "Model", [Block("a", 4 * GB, 3 * GB)])
    b = ComponentInput("b", "Model", [Block("b", 3 * GB, 3 * GB)])
    placement = resident([a, b], devices(10))
    assert maps(placement) == {"a": {"": 0}, "b": {"": 0}}
    use = placement.stages[0].use["0"]
    assert (use.weights, use.activations) == (7 * GB, 3 * GB)


def test_a_split_components_inputs_and_outputs_are_held_where_it_starts_and_ends():
    """Kills `io-ignored-when-split`. Two 7 GB GPUs; four 3 GB blocks; 1 GB of inputs and outputs.

    12 GB split 6 | 6; GPU 0 holds the inputs while the first block runs, GPU 1 the outputs: 7 and 7.
    """
    comp = ComponentInput("t", "Model", [Block(f"blocks.{i}", 3 * GB) for i in range(4)], io_bytes=1 * GB)
    placement = resident([comp], devices(7, 7))
    assert maps(placement)["t"] == {"blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1}
    assert {k: (u.weights, u.activations) for k, u in placement.stages[0].use.items()} == {
        "0": (6 * GB, 1 * GB), "1": (6 * GB, 1 * GB)}


def test_a_component_whose_forward_fits_no_gpu_runs_on_the_cpu():
    """GPU 0 of 10 GB, a cpu; blocks of 5 and 1 GB, forward peak 5 GB.

    On GPU 0, whole or with one block offloaded (which still runs there), the component needs its
    6 GB of weights or weights plus reserve, and its 5 GB forward peak: 11 > 10. Only the cpu runs it.
    """
    comp = ComponentInput("t", "Model", [Block("blocks.0", 5 * GB), Block("blocks.1", 1 * GB, 1 * GB)],
                          activation_peak=5 * GB)
    placement = resident([comp], devices(10, cpu=100))
    assert maps(placement) == {"t": {"": "cpu"}}
    assert any("runs on the cpu" in w for w in placement.warnings)


def test_the_balanced_strategy_never_offloads_to_balance():
    """Kills `balanced-allows-offload`. Two 8 GB GPUs and a cpu; ten 1 GB blocks: 5 | 5, nothing offloaded."""
    placement = plan_pipeline([chain("t", [1] * 10)], [Stage("denoise", ("t",))], devices(8, 8, cpu=100),
                              strategy="balanced")
    assert placement.offloaded_bytes == 0
    assert placement.stages[0].peak_bytes == {"0": 5 * GB, "1": 5 * GB}


def test_auto_mode_stages_when_loading_everything_would_offload():
    """Kills `auto-keeps-more-offload`. GPU 0 of 8 GB, a cpu; encoder 6 GB, denoiser 6 GB, VAE 1 GB.

    Loaded together (13 GB) something goes to the cpu; one stage at a time each fits GPU 0 alone.
    """
    comps = [whole("text_encoder", 6), whole("transformer", 6), whole("vae", 1, splittable=False)]
    stages = [Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)), Stage("decode", ("vae",))]
    placement = plan_pipeline(comps, stages, devices(8, cpu=100), mode="auto")
    assert placement.mode == "staged" and placement.offloaded_bytes == 0
    assert maps(placement) == {"text_encoder": {"": 0}, "transformer": {"": 0}, "vae": {"": 0}}


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
