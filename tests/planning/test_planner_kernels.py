"""The planner's steps one at a time, on hand-made inputs (no search around them).

tests/planning/test_planner_search.py pins what the whole search finds; these pin what each named step of
`dm_cli/planning/placement/search.py` decides on its own, so that a broken step fails its own test. Each docstring says
what the step decides and which mutant of `scripts/mutation_planner.py` (or which wrong answer) the
test catches. Sizes are plain bytes.
"""

import pytest

from dm_cli.planning.placement.blocks import (
    Block,
    ComponentInput,
    _collect_atomic,
    _enclosing,
    _first_call,
    _ModuleTree,
    _peak_of,
)
from dm_cli.planning.placement.placement import DeviceUse, NoFit
from dm_cli.planning.placement.search import (
    Device,
    Stage,
    _block_activation,
    _block_gpu,
    _Cand,
    _compute_devices,
    _evaluate,
    _fill,
    _fill_moved,
    _FillSpec,
    _FillState,
    _limits_at,
    _Pipeline,
    _place_split,
    _place_whole,
    _ResidencySearch,
    _together_note,
)

CPU = Device("cpu", 100)


def comp(name, sizes, acts=None, **kw):
    acts = acts or [0] * len(sizes)
    return ComponentInput(name, "M", [Block(f"b.{i}", s, a) for i, (s, a) in enumerate(zip(sizes, acts))], **kw)


def state(gpus, offload=(), reserves=None, limits=None):
    return _FillState(list(gpus), limits or {d.name: d.capacity for d in gpus}, list(offload), reserves or {})


# --- atomic blocks from a skeleton ------------------------------------------------------------------

TREE_MODULES = [("", "Root"), ("enc", "Enc"), ("enc.0", "L"), ("enc.1", "L"), ("dec", "NoSplit"), ("dec.0", "L"),
                ("empty", "L")]
TREE_TENSORS = [("pos", 4), ("enc.0.weight", 3), ("enc.1.weight", 2), ("dec.0.weight", 5), ("dec.0.bias", 1)]


def test_enclosing_is_the_nearest_listed_module():
    """`_enclosing` decides which module owns a dotted name: the nearest enclosing one that is listed,
    skipping names that are not modules. Fails when it returns the plain dotted parent ("a.b.c")."""
    modules = {"", "a", "a.b"}
    assert _enclosing("a.b.c.weight", modules) == "a.b"
    assert _enclosing("a.x", modules) == "a"
    assert _enclosing("weight", modules) == ""


def test_module_tree_counts_bytes_below_each_module():
    """`_ModuleTree.of` decides each module's children, the tensors it holds itself and the bytes below
    it; modules with no tensors below are left out of `subtree_bytes` (so the walk skips them). Fails
    when a module's bytes are only its last tensor's, not the sum."""
    tree = _ModuleTree.of(TREE_MODULES, TREE_TENSORS)
    assert tree.children[""] == ["enc", "dec", "empty"] and tree.children["enc"] == ["enc.0", "enc.1"]
    assert tree.direct[""] == [("pos", 4)] and tree.direct["dec.0"] == [("dec.0.weight", 5), ("dec.0.bias", 1)]
    assert tree.subtree_bytes == {"": 15, "enc": 5, "enc.0": 3, "enc.1": 2, "dec": 6, "dec.0": 6}


def test_atomic_blocks_stop_at_no_split_and_unsplittable_modules():
    """`_collect_atomic` decides the atomic blocks: the root's own tensors as entries, children split
    down to leaves, a no-split class (dec) or a module the trace reports unsplittable (enc) kept whole.
    Fails when `unsplittable` is ignored (enc.0 and enc.1 apart)."""
    tree = _ModuleTree.of(TREE_MODULES, TREE_TENSORS)
    found = []
    _collect_atomic(tree, "", {"NoSplit"}, set(), found)
    assert found == [("pos", 4), ("enc.0", 3), ("enc.1", 2), ("dec", 6)]
    found = []
    _collect_atomic(tree, "", set(), {"enc"}, found)
    assert found == [("pos", 4), ("enc", 5), ("dec.0", 6)]


def test_first_call_is_the_earliest_call_inside_a_block():
    """`_first_call` decides when a block first runs: its own call or an earlier one of a submodule; a
    root tensor entry runs first (-1), a module's tensor entry when its module starts, never-run: inf.
    Fails when submodules' calls are ignored (enc at 5)."""
    cls_of = {"enc": "E", "enc.0": "L", "dec": "D", "ghost": "L"}
    position = {"dec": 1, "enc.0": 2, "enc": 5}
    assert _first_call("enc", cls_of, position) == 2
    assert _first_call("dec", cls_of, position) == 1
    assert _first_call("pos", cls_of, position) == -1
    assert _first_call("enc.scale", cls_of, position) == 5
    assert _first_call("ghost", cls_of, position) == float("inf")


def test_peak_of_a_block_is_its_own_or_its_largest_submodules():
    """`_peak_of` decides a block's activation: the trace's own peak, else the largest inside it (by
    dotted prefix: "bb" is not inside "b"), else 0. Fails when only the own peak counts (b: 0)."""
    peaks = {"a": 3, "b.0": 2, "b.1": 5, "bb": 9}
    assert (_peak_of("a", peaks), _peak_of("b", peaks), _peak_of("c", peaks)) == (3, 5, 0)


# --- the fill ----------------------------------------------------------------------------------------


def test_room_counts_weights_reserve_the_largest_activation_and_overhead():
    """`_FillState.room` decides whether a block fits a GPU: weights + reserve + the largest activation
    (blocks run in turn) + overhead, up to the limit inclusive. Kills `room-ignores-reserve`,
    `room-ignores-overhead`, `room-ignores-activations`, `room-sums-activations` and `room-strict`."""
    gpu = Device(0, 10, 1)
    fill = state([gpu], reserves={"0": 2})
    fill.take(gpu, 3, 2)
    fill.take(gpu, 0, 1)  # `take` keeps the largest activation, not the sum
    assert (fill.weights["0"], fill.acts["0"]) == (3, 2)
    assert fill.room(gpu, 2, 1)  # 3 + 2 + 2 + max(2, 1) + 1 = 10: exactly full fits
    assert not fill.room(gpu, 3, 0)  # 11
    assert not fill.room(gpu, 2, 3)  # 3 + 2 + 2 + 3 + 1 = 11


def test_offload_target_is_the_first_offload_device_with_room():
    """`_FillState.offload_target` decides where an offloaded block goes: the cpu while it has room, then
    disk; with no room anywhere the bytes are unplaced. Kills `offload-ignores-cpu-capacity`."""
    fill = state([], [Device("cpu", 5), Device("disk", None)])
    assert [fill.offload_target(3), fill.offload_target(3), fill.offload_target(2)] == ["cpu", "disk", "cpu"]
    assert fill.unplaced == 0
    tight = state([], [Device("cpu", 5)])
    assert [tight.offload_target(3), tight.offload_target(3)] == ["cpu", "cpu"] and tight.unplaced == 3
    assert state([]).offload_target(4) == "cpu"


def test_place_whole_takes_the_best_fit_or_the_first_from_the_cursor():
    """`_place_whole` decides the one device of a whole component: whole-first takes the GPU it leaves
    with the least room, charging its forward's activation; otherwise the first GPU from the cursor
    (which moves there). Kills `first-fit`, `worst-fit` and `whole-activation-ignored` (through `_fill`)."""
    g0, g1 = Device(0, 10), Device(1, 6)
    assert _place_whole(state([g0, g1]), comp("a", [5]), 0, prefer_whole=True) == {"": 1}
    assert _place_whole(state([g0, g1]), comp("a", [5]), 2, prefer_whole=True) == {"": 0}  # 5 + 2 > 6
    fill = state([g0, g1])
    fill.cursor = 1
    assert _place_whole(fill, comp("a", [5], splittable=False), 0, prefer_whole=False) == {"": 1}
    fill = state([g1, g0])
    assert _place_whole(fill, comp("a", [8], splittable=False), 0, prefer_whole=False) == {"": 0}
    assert fill.cursor == 1
    assert _fill([comp("a", [5], splittable=False, activation_peak=2)], [g1, g0], {"1": 6, "0": 10}, [], {},
                 False).maps == {"a": {"": 0}}


def test_place_whole_offloads_a_non_splittable_component_and_leaves_a_splittable_one_to_split():
    """A component no GPU holds whole: `_place_whole` offloads it whole when it cannot be split, and
    returns None (split it) when it can."""
    g0 = Device(0, 10)
    assert _place_whole(state([g0], [CPU]), comp("vae", [12], splittable=False), 0, False) == {"": "cpu"}
    assert _place_whole(state([g0], [CPU]), comp("t", [6, 6]), 0, True) is None


def test_place_split_fills_gpus_in_turn_then_offloads_and_collapses_a_single_device():
    """`_place_split` decides a split component's map: blocks on the GPUs in order, the rest offloaded;
    one entry {"": d} when every block landed on the same device. Fails when it keeps one key per block."""
    g0, g1 = Device(0, 4), Device(1, 4)
    assert _place_split(state([g0, g1], [CPU]), comp("t", [3, 3, 3]), 0, False) == \
        {"b.0": 0, "b.1": 1, "b.2": "cpu"}
    assert _place_split(state([g0, g1], [CPU]), comp("t", [1, 1]), 0, False) == {"": 0}


def test_block_gpu_skips_a_block_only_on_the_last_gpu():
    """`_block_gpu` decides the GPU a block takes and moves the cursor past GPUs without room; with skip,
    a block missing the last GPU is offloaded (None) and the cursor stays for the next block.
    Kills `skip-on-every-gpu` (the first case) and `no-skip-fill`'s effect (the second)."""
    g0, g1 = Device(0, 5), Device(1, 2)
    t = comp("t", [5, 2, 3, 1])
    fill = state([g0, g1])
    fill.take(g0, 5, 0)  # GPU 0 full
    assert _block_gpu(fill, t, 1, {}, {0, 1}, 0, skip=True) == 1  # moves on from a full GPU that is not the last
    assert _block_gpu(fill, t, 2, {}, {0, 1}, 0, skip=True) is None and fill.cursor == 1
    assert _block_gpu(fill, t, 2, {}, {0, 1}, 0, skip=False) is None and fill.cursor == 2


def test_block_activation_charges_io_at_the_ends_and_the_whole_peak_on_the_last_block():
    """`_block_activation` decides what a block charges for activations: its own; the component's inputs
    and outputs on the first and last block; its whole forward's peak on the last block when no earlier
    block is on another GPU (a block on the cpu does not count). Kills `no-whole-peak-in-fill`; fails
    when the inputs and outputs are not charged (3)."""
    t = comp("t", [1, 1, 1], [1, 0, 2], io_bytes=3, activation_peak=6)
    g0 = Device(0, 100)
    assert _block_activation(t, 1, {"b.0": 0}, g0, {0, 1}, 6) == 0
    assert _block_activation(t, 0, {}, g0, {0, 1}, 6) == 3
    assert _block_activation(t, 2, {"b.0": 0, "b.1": 0}, g0, {0, 1}, 6) == 6
    assert _block_activation(t, 2, {"b.0": "cpu", "b.1": 0}, g0, {0, 1}, 6) == 6
    assert _block_activation(t, 2, {"b.0": 1, "b.1": 0}, g0, {0, 1}, 6) == 3


def test_fill_continues_the_next_component_from_the_cursor():
    """`_fill` decides a whole candidate: components in the given order share one cursor, so the next
    component starts on the GPU where the last one ended. Kills `cursor-per-component`."""
    g0, g1 = Device(0, 4), Device(1, 7)
    cand = _fill([comp("a", [2, 5]), comp("b", [1, 1])], [g0, g1], {"0": 4, "1": 7}, [CPU], {}, False)
    assert cand.maps == {"a": {"b.0": 0, "b.1": 1}, "b": {"": 1}} and cand.unplaced == 0


# --- the residency search ----------------------------------------------------------------------------


def test_compute_devices_lets_the_cpu_compute_when_there_is_no_gpu():
    """`_compute_devices` decides which devices compute and which hold offloaded blocks: GPUs and
    cpu/disk; on a GPU-less list the cpu computes and only disk holds. Fails when the GPU-less rule is
    dropped (nothing computes)."""
    disk, g0 = Device("disk", None), Device(0, 8)
    assert _compute_devices([CPU, disk]) == ([CPU], [disk])
    assert _compute_devices([g0, CPU, disk]) == ([g0], [CPU, disk])


def test_limits_at_scales_every_gpu_and_zeroes_one():
    """`_limits_at` decides the balanced search's per-GPU limits: capacity times the fraction, rounded
    down; balanced_low_0's first GPU gets 0. Kills `balanced-zero-first-ignored`."""
    assert _limits_at({"0": 10, "1": 7}, 0.5) == {"0": 5, "1": 3}
    assert _limits_at({"0": 10, "1": 7}, 0.5, "0") == {"0": 0, "1": 3}


def test_fill_moved_when_a_block_moves_or_something_is_unplaced():
    """`_fill_moved` decides whether a refill changed the candidate (the scaling stops there): a new
    map, or bytes no device holds. Fails when unplaced bytes are ignored."""
    cand = _Cand({"t": {"": 0}})
    assert not _fill_moved(_Cand({"t": {"": 0}}), cand)
    assert _fill_moved(_Cand({"t": {"": 0}}, unplaced=1), cand)
    assert _fill_moved(_Cand({"t": {"": "cpu"}}), cand)


def test_grown_reserves_charge_the_stream_and_the_excess_times_over():
    """`_ResidencySearch.grown` decides the next fill's reserves: at least what each GPU streams, and
    its excess over capacity `times` over on top of the reserve so far; cpu entries are not charged.
    Kills `refill-ignores-overflow`."""
    search = _ResidencySearch([comp("t", [1])], [Device(0, 10), CPU])
    use = {"0": DeviceUse(weights=8, reserve=3, activations=1), "cpu": DeviceUse(weights=200)}  # GPU 0: 2 over
    assert search.grown({}, use, 1) == {"0": 3}
    assert search.grown({}, use, 3) == {"0": 6}
    assert search.grown({"0": 4}, use, 1) == {"0": 6}


def test_refill_offloads_until_the_reserve_fits():
    """`_ResidencySearch.refill` decides one fill style's candidate: the fill, refilled with the reserves
    it showed until it fits (use) or cannot (None). The skip fill of tests/planning/test_planner_search.py's first
    case (one 4-byte GPU; blocks 2, 3, 1): the 3-byte block is offloaded alone. Kills `no-refill`."""
    t = comp("t", [2, 3, 1])
    search = _ResidencySearch([t], [Device(0, 4), CPU])
    cand, use = search.refill(_FillSpec([t], search.gpus, search.full, False, skip=True))
    assert cand.maps == {"t": {"b.0": "cpu", "b.1": "cpu", "b.2": 0}}
    assert (use["0"].weights, use["0"].reserve) == (1, 3)
    tight = _ResidencySearch([t], [Device(0, 4), Device("cpu", 2)])
    cand, use = tight.refill(_FillSpec([t], tight.gpus, {"0": 0}, False))  # no GPU room, 2 bytes of cpu
    assert use is None and cand.unplaced == 4


def test_moving_multiple_is_the_fewest_charges_that_change_the_fill():
    """`_ResidencySearch.moving_multiple` decides how many times a 1-byte excess is charged when once
    changes nothing: blocks 6 and 3 on a 20-byte GPU stay together up to a reserve of 11, so 12 (found by
    doubling to 16 and bisecting back). Kills `refill-overshoots` (16)."""
    t = comp("t", [6, 3])
    search = _ResidencySearch([t], [Device(0, 20), CPU])
    spec = _FillSpec([t], search.gpus, search.full, False)
    cand = search.fill(spec, {})
    use = {"0": DeviceUse(weights=9, activations=12)}  # 21: 1 over
    assert search.moving_multiple(spec, {}, use, cand) == 12


def test_score_ranks_offload_then_disk_then_hops_then_the_fullest_gpu():
    """`_ResidencySearch.score` decides which candidate is better: bytes offloaded, then on disk, then
    hops, then the largest share of a GPU. Kills `hops-before-offload` and `no-balance-score`."""
    t = comp("t", [2, 3, 4])
    devices = [Device(0, 10), Device(1, 10), CPU]
    search = _ResidencySearch([t], devices)
    maps = {"t": {"b.0": 0, "b.1": 1, "b.2": "cpu"}}  # b.2 streams through GPU 0 (reserve 4)
    assert search.score(maps, _evaluate([t], maps, search.by_name)) == (4, 0, 2, 0.6)


def test_balanced_finds_the_smallest_common_share_without_offload():
    """`_ResidencySearch.balanced` decides the most even cut: the smallest fraction of every GPU that
    holds everything with nothing offloaded (two 8-byte GPUs, ten 1-byte blocks: 5 | 5, not 4 | 4 and
    2 on the cpu). Kills `balanced-allows-offload`."""
    t = comp("t", [1] * 10)
    search = _ResidencySearch([t], [Device(0, 8), Device(1, 8), CPU])
    cand, use = search.balanced([t], search.gpus, False)
    assert {k: u.peak for k, u in use.items()} == {"0": 5, "1": 5}
    assert _ResidencySearch([comp("t", [9])], [Device(0, 8), CPU]).balanced([comp("t", [9])], [Device(0, 8)],
                                                                            False) is None


def test_greedy_tries_every_gpu_order_component_order_and_fill_style():
    """`_ResidencySearch.greedy` decides which fills auto tries: every order of up to 4 GPUs, execution
    and largest-first component orders, split and whole-first, with and without skip (when something
    can be offloaded); those that fit, best score first. Kills `no-gpu-permutations`,
    `gpu-order-and-reverse-only`, `no-largest-first`, `no-prefer-whole` and `no-skip-fill`."""
    a, b = comp("a", [1]), comp("b", [2])
    search = _ResidencySearch([a, b], [Device(0, 100), Device(1, 100), Device(2, 100), CPU])
    tried = search.greedy()
    styles = {(tuple(d.key for d in t.spec.gpu_order), tuple(c.name for c in t.spec.comps), t.spec.prefer_whole,
               t.spec.skip) for t in tried}
    assert len(tried) == len(styles) == 6 * 2 * 2 * 2
    assert {s[1] for s in styles} == {("a", "b"), ("b", "a")}
    assert [t.score for t in tried] == sorted(t.score for t in tried)


def test_refined_balances_the_best_fills_only_when_they_offload_nothing():
    """`_ResidencySearch.refined` decides auto's balanced refinement: the balanced cut of up to four of
    the best greedy fills when those offload nothing, none otherwise. Kills `no-balanced-refinement`."""
    t = comp("t", [1] * 10)
    search = _ResidencySearch([t], [Device(0, 8), Device(1, 8)])
    refined = search.refined(search.greedy())
    assert refined and all({k: u.peak for k, u in use.items()} == {"0": 5, "1": 5} for _, use in refined)
    tight = _ResidencySearch([t], [Device(0, 4), Device(1, 4), CPU])
    assert tight.refined(tight.greedy()) == []


def test_candidates_follow_the_strategy():
    """`_ResidencySearch.candidates` decides what each strategy proposes: sequential fills GPU 0 first,
    balanced takes the same share of each, balanced_low_0 leaves GPU 0 empty (ten 1-byte blocks; GPUs of
    8, 8 and 10 bytes). Fails when sequential fills the GPUs in another order."""
    t = comp("t", [1] * 10)
    search = _ResidencySearch([t], [Device(0, 8), Device(1, 8), Device(2, 10)])

    def peaks(strategy):
        (cand, use), *_ = search.candidates(strategy)
        return {k: u.peak for k, u in use.items()}

    assert peaks("sequential") == {"0": 8, "1": 2}
    assert peaks("balanced") == {"0": 3, "1": 3, "2": 4}
    assert peaks("balanced_low_0") == {"1": 4, "2": 6}


def test_best_keeps_the_best_score_the_cpu_as_last_resort_or_no_fit():
    """`_ResidencySearch.best` decides the residency's placement: the best-scoring candidate (5 | 5,
    not a lopsided cut); the all-cpu placement when no GPU candidate fits (the search reaches it itself:
    the explicit last resort is an equivalent mutant, see the script); NoFit when nothing does.
    Kills `worst-plan-chosen`."""
    t = comp("t", [1] * 10)
    _, use = _ResidencySearch([t], [Device(0, 8), Device(1, 8)]).best("auto")
    assert {k: u.peak for k, u in use.items()} == {"0": 5, "1": 5}
    big = comp("t", [5, 1], [0, 1], activation_peak=5)  # its forward fits no 10-byte GPU
    maps, _ = _ResidencySearch([big], [Device(0, 10), CPU]).best("auto")
    assert maps == {"t": {"": "cpu"}}
    with pytest.raises(NoFit):
        _ResidencySearch([t], [Device(0, 4)]).best("auto")


# --- resident or staged ------------------------------------------------------------------------------

A, B = comp("a", [4], [2]), comp("b", [3], [1])
TWO_STAGES = [Stage("encode", ("a",)), Stage("denoise", ("b",))]


def test_stage_use_keeps_every_weight_loaded_when_resident():
    """`_Pipeline.stage_use` decides a stage's memory: resident keeps every component's weights but only
    this stage's activations; staged loads only this stage's components. Fails when resident is counted
    as staged (weights 4)."""
    pipeline = _Pipeline([A, B], TWO_STAGES, [Device(0, 20)], "auto")
    maps = {"a": {"": 0}, "b": {"": 0}}
    resident = pipeline.stage_use("resident", TWO_STAGES[0], maps)["0"]
    staged = pipeline.stage_use("staged", TWO_STAGES[0], maps)["0"]
    assert (resident.weights, resident.activations) == (7, 2)
    assert (staged.weights, staged.activations) == (4, 2)


def test_component_placement_reports_the_map_execution_device_and_offload():
    """`_Pipeline.component_placement` decides what a component's placement reports: its map, the GPU
    that runs offloaded blocks, offloaded bytes, hops and its stage. Fails when the execution device is
    taken as the cpu, or the stage is lost."""
    t = comp("t", [2, 3])
    pipeline = _Pipeline([t], [Stage("denoise", ("t",))], [Device(0, 4), CPU], "auto")
    placed = pipeline.component_placement(t, {"t": {"b.0": "cpu", "b.1": 0}})
    assert (placed.device_map, placed.execution_device, placed.offloaded_bytes, placed.hops, placed.stage) == \
        ({"b.0": "cpu", "b.1": 0}, 0, 2, 0, "denoise")


def test_finish_warns_of_a_component_that_runs_on_no_gpu():
    """`_Pipeline.finish` decides the Placement and its warnings: a component on the cpu of a list with
    GPUs is named (it runs there, slowly). Fails when the warning is dropped."""
    pipeline = _Pipeline([A, B], TWO_STAGES, [Device(0, 20), CPU], "auto")
    placement = pipeline.finish("staged", [(TWO_STAGES[0], {"a": {"": 0}}, ""),
                                           (TWO_STAGES[1], {"b": {"": "cpu"}}, "")], [])
    assert [s.name for s in placement.stages] == ["encode", "denoise"]
    assert placement.warnings == ["b fits no GPU with its activations: it runs on the cpu (slow)."]


def test_exclusive_loads_both_when_that_offloads_nothing_else_one_at_a_time():
    """`_Pipeline.exclusive` decides how an exclusive stage's components load: together when nothing is
    offloaded (a 12-byte GPU, two 6-byte experts), else one at a time when that offloads less (a 10-byte
    GPU), with a warning; `one_at_a_time` names the switch in each sub-stage's note. Fails when an
    exclusive stage always loads together (the 10-byte GPU would offload 2)."""
    experts = [comp("transformer", [6]), comp("transformer_2", [6])]
    stage = Stage("denoise", ("transformer", "transformer_2"), exclusive=True)
    together, note = _Pipeline(experts, [stage], [Device(0, 12), CPU], "auto").exclusive(stage)
    assert [(s.components, n) for s, _, n in together] == [(stage.components, _together_note(stage))] and not note
    parts, note = _Pipeline(experts, [stage], [Device(0, 10), CPU], "auto").exclusive(stage)
    assert [(s.components, m) for s, m, _ in parts] == [(("transformer",), {"transformer": {"": 0}}),
                                                         (("transformer_2",), {"transformer_2": {"": 0}})]
    assert "freed at the switch" in parts[0][2] and "loaded one at a time" in note


def test_resident_and_staged_place_the_same_components_differently():
    """`_Pipeline.resident` loads every component for the whole run (one residency); `staged` one stage
    at a time, so each stage may use the whole GPU (two 6-byte components on an 8-byte GPU). Fails when
    resident plans as staged (nothing offloaded)."""
    comps = [comp("a", [6]), comp("b", [6])]
    pipeline = _Pipeline(comps, [Stage("encode", ("a",)), Stage("denoise", ("b",))], [Device(0, 8), CPU], "auto")
    assert pipeline.resident().offloaded_bytes == 6
    staged = pipeline.staged()
    assert staged.offloaded_bytes == 0 and {n: c.device_map for n, c in staged.components.items()} == \
        {"a": {"": 0}, "b": {"": 0}}


def test_finish_says_when_the_cpu_it_runs_on_was_never_listed():
    """With `0=…,disk` and no cpu, a component that fits no GPU computes in host RAM outside any budget: the
    warning says so and how to budget it (issue 23: it said only "runs on the cpu"). Fails when the suffix is
    dropped, or given although the cpu is listed (the test above)."""
    disk = Device("disk", None)
    pipeline = _Pipeline([A, B], TWO_STAGES, [Device(0, 20), disk], "auto")
    placement = pipeline.finish("staged", [(TWO_STAGES[0], {"a": {"": 0}}, ""),
                                           (TWO_STAGES[1], {"b": {"": "disk"}}, "")], [])
    assert len(placement.warnings) == 1 and "runs on the cpu" in placement.warnings[0]
    assert "--max-memory does not list" in placement.warnings[0] and "add cpu=SIZE" in placement.warnings[0]
