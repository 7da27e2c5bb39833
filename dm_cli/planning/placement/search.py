"""The pure planner: (component blocks with bytes and activations, stages, devices, strategy, mode) -> placement.

No torch, no I/O. Everything here is plain data so that planning is fast, cacheable and testable by
hand. `components.py` cuts skeletons and meta traces into the inputs (`blocks.py`); `make.py` turns the
answer (`placement.py`) into a Plan.

Model of memory on a device during a stage:
    weights of every block placed there
  + the offload reserve (largest cpu/disk block streamed to it, when something is offloaded)
  + the largest activation of any component running there (components in a stage run one after another)
  + the per-device overhead (CUDA context, allocator slack), once the device is used.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import NamedTuple

from dm_cli.families.stages import Stage
from dm_cli.planning.modes import Mode, Strategy
from dm_cli.planning.placement.blocks import ComponentInput
from dm_cli.planning.placement.placement import ComponentPlacement, DeviceUse, NoFit, Placement, StagePlacement

# --- inputs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    key: int | str  # GPU index, "mps", "cpu" or "disk"
    capacity: int | None  # None: unlimited (disk)
    overhead: int = 0  # charged once the device is used

    @property
    def is_gpu(self) -> bool:
        return isinstance(self.key, int) or self.key == "mps"

    @property
    def name(self) -> str:
        return str(self.key)


# --- placement ------------------------------------------------------------------------------------


@dataclass
class _Cand:
    """One candidate placement of a set of components onto devices (one residency)."""

    maps: dict[str, dict[str, int | str]]
    unplaced: int = 0


def _exec_device(comp_map: dict[str, int | str], devices: dict[str, Device]):
    for device in comp_map.values():
        if devices[str(device)].is_gpu:
            return device
    return "cpu"


def _evaluate(comps: list[ComponentInput], maps: dict[str, dict[str, int | str]],
              devices: dict[str, Device]) -> dict[str, DeviceUse]:
    """Exact per-device use of components loaded together (they run one after another)."""
    use: dict[str, DeviceUse] = {}
    acts: dict[str, int] = {}
    reserve: dict[str, int] = {}
    for comp in comps:
        comp_map = maps[comp.name]
        main = _exec_device(comp_map, devices)
        comp_acts: dict[str, int] = {}
        offloaded = 0
        for block in comp.blocks:
            device = comp_map[block.name] if block.name in comp_map else comp_map[""]
            key = str(device)
            use.setdefault(key, DeviceUse()).weights += block.bytes
            if devices[key].is_gpu or str(main) not in devices:
                runs_on = key
            else:  # cpu/disk blocks run on the execution device (a GPU, or the cpu of a GPU-less list)
                runs_on = str(main)
            if not devices[key].is_gpu and runs_on != key:
                offloaded = max(offloaded, block.bytes)
            comp_acts[runs_on] = max(comp_acts.get(runs_on, 0), block.activation)
        if len(comp_acts) == 1:
            (only,) = comp_acts
            comp_acts[only] = max(comp_acts[only], comp.activation_peak, comp.io_bytes)
        elif comp.blocks and comp.io_bytes:
            for block in (comp.blocks[0], comp.blocks[-1]):
                device = comp_map.get(block.name, comp_map.get(""))
                key = str(device) if devices[str(device)].is_gpu else str(main)
                comp_acts[key] = max(comp_acts.get(key, 0), comp.io_bytes)
        for key, value in comp_acts.items():
            acts[key] = max(acts.get(key, 0), value)
            use.setdefault(key, DeviceUse())
        if offloaded:
            reserve[str(main)] = max(reserve.get(str(main), 0), offloaded)
            use.setdefault(str(main), DeviceUse())
    for key, entry in use.items():
        entry.activations = acts.get(key, 0)
        entry.reserve = reserve.get(key, 0)
        entry.overhead = devices[key].overhead
    return use


def _fits(use: dict[str, DeviceUse], devices: dict[str, Device]) -> bool:
    for key, entry in use.items():
        capacity = devices[key].capacity
        if capacity is not None and entry.peak > capacity:
            return False
    return True


class _FillState:
    """What one fill has charged so far: each GPU's weights and largest activation, the offload devices'
    free room, the GPU cursor (a component's blocks never return to an earlier GPU) and unplaced bytes."""

    def __init__(self, gpu_order: list[Device], limits: dict[str, int], offload: list[Device],
                 reserves: dict[str, int]):
        self.gpu_order = gpu_order
        self.limits = limits
        self.offload = offload
        self.reserves = reserves
        self.weights = {d.name: 0 for d in gpu_order}
        self.acts: dict[str, int] = {d.name: 0 for d in gpu_order}
        self.off_free = {d.name: d.capacity for d in offload}
        self.cursor = 0
        self.unplaced = 0

    def room(self, device: Device, add_weights: int, add_act: int) -> bool:
        """Whether `device` stays within its limit with `add_weights` more and an activation of `add_act`
        (activations on one device peak one at a time; the pre-charged reserve and overhead count too)."""
        key = device.name
        total = (self.weights[key] + add_weights + self.reserves.get(key, 0) + max(self.acts[key], add_act)
                 + device.overhead)
        return total <= self.limits[key]

    def take(self, device: Device, add_weights: int, add_act: int) -> None:
        self.weights[device.name] += add_weights
        self.acts[device.name] = max(self.acts[device.name], add_act)

    def offload_target(self, nbytes: int) -> int | str:
        """The first offload device with room for `nbytes` (cpu, then disk); when none has room the bytes
        count as unplaced (the candidate is rejected) and are put on the last one."""
        for device in self.offload:
            free = self.off_free[device.name]
            if free is None or free >= nbytes:
                if free is not None:
                    self.off_free[device.name] = free - nbytes
                return device.key
        self.unplaced += nbytes
        return self.offload[-1].key if self.offload else "cpu"


def _fill(comps: list[ComponentInput], gpu_order: list[Device], limits: dict[str, int],
          offload: list[Device], reserves: dict[str, int], prefer_whole: bool, skip: bool = False) -> _Cand:
    """Contiguous fill in execution order: GPUs in `gpu_order` up to `limits`, then cpu, then disk.

    The cursor never returns to an earlier GPU within a component; a non-splittable component goes
    whole to the first GPU (from the cursor) with room. `reserves` pre-charges offload reserves.
    With `skip`, a block that misses the last GPU is offloaded alone and later blocks still try it.
    """
    state = _FillState(gpu_order, limits, offload, reserves)
    maps: dict[str, dict[str, int | str]] = {}
    for comp in comps:
        whole_act = max(comp.activation_peak, comp.io_bytes, max((b.activation for b in comp.blocks), default=0))
        if not comp.splittable or prefer_whole:
            whole = _place_whole(state, comp, whole_act, prefer_whole)
            if whole is not None:
                maps[comp.name] = whole
                continue
        maps[comp.name] = _place_split(state, comp, whole_act, skip)
    return _Cand(maps, state.unplaced)


def _place_whole(state: _FillState, comp: ComponentInput, whole_act: int,
                 prefer_whole: bool) -> dict[str, int | str] | None:
    """The component on one device with its whole forward's activation: whole-first takes the GPU it fills
    best (any GPU); otherwise the first GPU from the cursor with room, which becomes the cursor. A
    non-splittable component no GPU holds is offloaded whole. None: split it instead."""
    total = comp.weights_bytes
    candidates = state.gpu_order[state.cursor:] if not prefer_whole else state.gpu_order
    fitting = [d for d in candidates if state.room(d, total, whole_act)]
    if fitting:
        if prefer_whole:  # best fit: the GPU left with the least room
            device = min(fitting, key=lambda d: state.limits[d.name] - state.weights[d.name])
        else:
            device = fitting[0]
        state.take(device, total, whole_act)
        if not prefer_whole:
            state.cursor = state.gpu_order.index(device)
        return {"": device.key}
    if not comp.splittable:
        return {"": state.offload_target(total)}
    return None


def _place_split(state: _FillState, comp: ComponentInput, whole_act: int, skip: bool) -> dict[str, int | str]:
    """Each block on the GPU at the cursor or a later one, else offloaded; {"": d} when all share one device."""
    comp_map: dict[str, int | str] = {}
    gpu_keys = {d.key for d in state.gpu_order}
    for index, block in enumerate(comp.blocks):
        device = _block_gpu(state, comp, index, comp_map, gpu_keys, whole_act, skip)
        comp_map[block.name] = device if device is not None else state.offload_target(block.bytes)
    if len(set(comp_map.values())) == 1:
        comp_map = {"": next(iter(comp_map.values()))}
    return comp_map


def _block_gpu(state: _FillState, comp: ComponentInput, index: int, comp_map: dict[str, int | str],
               gpu_keys: set, whole_act: int, skip: bool) -> int | str | None:
    """The GPU that takes block `index`: the cursor moves on past GPUs without room (with `skip`, never past
    the last one: the block is offloaded and later blocks try that GPU again). None: offload it."""
    block = comp.blocks[index]
    while state.cursor < len(state.gpu_order):
        device = state.gpu_order[state.cursor]
        act = _block_activation(comp, index, comp_map, device, gpu_keys, whole_act)
        if state.room(device, block.bytes, act):
            state.take(device, block.bytes, act)
            return device.key
        if skip and state.cursor == len(state.gpu_order) - 1:
            return None
        state.cursor += 1
    return None


def _block_activation(comp: ComponentInput, index: int, comp_map: dict[str, int | str], device: Device,
                      gpu_keys: set, whole_act: int) -> int:
    """What block `index` charges `device` for activations: its own, the component's inputs and outputs
    when it is the first or last block, and the whole forward's peak when it is the last block and no
    earlier block is on another GPU (the component then runs whole there, as `_evaluate` charges it)."""
    act = comp.blocks[index].activation
    last = index == len(comp.blocks) - 1
    if comp.io_bytes and (index == 0 or last):
        act = max(act, comp.io_bytes)
    if last and not any(d in gpu_keys and d != device.key for d in comp_map.values()):
        # the last block here runs the whole component on this GPU: charge its forward's peak, or the
        # fill must cut before it
        act = max(act, whole_act)
    return act


def _hops(comp: ComponentInput, comp_map: dict[str, int | str], devices: dict[str, Device]) -> int:
    if "" in comp_map and len(comp_map) == 1:
        return 0
    main = _exec_device(comp_map, devices)
    hops, last = 0, None
    for block in comp.blocks:
        device = comp_map[block.name]
        runs = device if devices[str(device)].is_gpu else main
        if last is not None and runs != last:
            hops += 1
        last = runs
    return hops


def _offloaded(comp: ComponentInput, comp_map: dict[str, int | str], devices: dict[str, Device]) -> tuple[int, int]:
    """(bytes offloaded, bytes on disk): on cpu or disk when the devices include a GPU; on a GPU-less
    list the cpu computes, so only disk bytes are offloaded."""
    has_gpu = any(d.is_gpu for d in devices.values())

    def offloaded(key: str) -> bool:
        return not devices[key].is_gpu and (has_gpu or key == "disk")

    if "" in comp_map and len(comp_map) == 1:
        key = str(comp_map[""])
        total = comp.weights_bytes
        return (total if offloaded(key) else 0, total if key == "disk" else 0)
    off = disk = 0
    for block in comp.blocks:
        key = str(comp_map[block.name])
        if offloaded(key):
            off += block.bytes
        if key == "disk":
            disk += block.bytes
    return off, disk


@dataclass(frozen=True)
class _FillSpec:
    """One way to fill: the component order, the GPU order, each GPU's limit, whole-first, skip."""

    comps: list[ComponentInput]
    gpu_order: list[Device]
    limits: dict[str, int]
    prefer_whole: bool
    skip: bool = False


class _Tried(NamedTuple):
    """A fill that fits, with its score (auto keeps the best and refines the best few)."""

    score: tuple
    spec: _FillSpec
    cand: _Cand
    use: dict[str, DeviceUse]


def _compute_devices(devices: list[Device]) -> tuple[list[Device], list[Device]]:
    """(devices that compute, devices that hold offloaded blocks): the GPUs, and the cpu then disk; with no
    GPU the cpu computes (weights, activations, the reserve for streaming) and disk holds the rest."""
    by_name = {d.name: d for d in devices}
    gpus = [d for d in devices if d.is_gpu]
    offload = [d for d in devices if not d.is_gpu]
    if not gpus and "cpu" in by_name:
        gpus, offload = [by_name["cpu"]], [d for d in offload if d.key == "disk"]
    return gpus, offload


def _limits_at(full: dict[str, int], fraction: float, zeroed: str | None = None) -> dict[str, int]:
    """Each GPU's capacity scaled by `fraction`; the `zeroed` GPU (balanced_low_0's first) gets none."""
    limits = {k: int(v * fraction) for k, v in full.items()}
    if zeroed is not None:
        limits[zeroed] = 0
    return limits


def _fill_moved(trial: _Cand, cand: _Cand) -> bool:
    """Whether a refill changed anything: a block moved, or something no longer fits anywhere."""
    return bool(trial.unplaced) or trial.maps != cand.maps


class _ResidencySearch:
    """The search for one residency (components loaded together) on one device list."""

    def __init__(self, comps: list[ComponentInput], devices: list[Device]):
        self.comps = comps
        self.devices = devices
        self.by_name = {d.name: d for d in devices}
        self.gpus, self.offload = _compute_devices(devices)
        self.full = {d.name: d.capacity for d in self.gpus}

    def fill(self, spec: _FillSpec, reserves: dict[str, int]) -> _Cand:
        return _fill(spec.comps, spec.gpu_order, spec.limits, self.offload, reserves, spec.prefer_whole, spec.skip)

    def grown(self, reserves: dict[str, int], use: dict[str, DeviceUse], times: int) -> dict[str, int]:
        """The next fill's reserves: what each GPU streams, and `times` its excess over capacity on top
        of its reserve so far (activations of offloaded blocks, overhead: what the fill did not see)."""
        out = dict(reserves)
        for key, entry in use.items():
            device = self.by_name[key]
            if device not in self.gpus:
                continue
            want = max(reserves.get(key, 0), entry.reserve)
            if device.capacity is not None and entry.peak > device.capacity:
                want = max(want, reserves.get(key, 0) + (entry.peak - device.capacity) * times)
            out[key] = want
        return out

    def refill(self, spec: _FillSpec) -> tuple[_Cand, dict[str, DeviceUse] | None]:
        """Fill, then re-fill with offload reserves until they settle; use None when it does not fit.

        A refill charges what the fill could not see (the streaming reserve, activations of offloaded
        blocks run on their execution GPU, the excess over capacity) as a reserve. When that leaves the
        fill unchanged (the excess is smaller than the block that must move), the excess is charged
        the smallest whole number of times that changes the fill (`moving_multiple`): a tiny
        excess takes few fills, and no more blocks move than charging it repeatedly would move.
        """
        reserves: dict[str, int] = {}
        cand = self.fill(spec, reserves)
        for _ in range(16):
            if cand.unplaced:
                return cand, None
            use = _evaluate(self.comps, cand.maps, self.by_name)
            if _fits(use, self.by_name):
                return cand, use
            step = self.grown(reserves, use, 1)
            if step == reserves:
                return cand, None
            following = self.fill(spec, step)
            if not _fill_moved(following, cand):
                times = self.moving_multiple(spec, reserves, use, cand)
                if times is None:
                    return cand, None
                step = self.grown(reserves, use, times)
                following = self.fill(spec, step)
            reserves, cand = step, following
        return cand, None

    def moving_multiple(self, spec: _FillSpec, reserves: dict[str, int], use: dict[str, DeviceUse],
                        cand: _Cand) -> int | None:
        """The fewest times (> 1) the excess must be charged before the fill changes: doubling, then
        bisecting. None when no charge up to 2**40 times changes it."""
        low, high = 1, 2
        while not _fill_moved(self.fill(spec, self.grown(reserves, use, high)), cand):
            if high > 1 << 40:
                return None
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            if _fill_moved(self.fill(spec, self.grown(reserves, use, middle)), cand):
                high = middle
            else:
                low = middle
        return high

    def score(self, maps: dict[str, dict[str, int | str]], use: dict[str, DeviceUse]) -> tuple:
        """Lower is better: bytes offloaded, bytes on disk, hops, then the largest share of a GPU used."""
        off = disk = hops = 0
        for comp in self.comps:
            o, d = _offloaded(comp, maps[comp.name], self.by_name)
            off, disk, hops = off + o, disk + d, hops + _hops(comp, maps[comp.name], self.by_name)
        util = max((use[g.name].peak / g.capacity for g in self.gpus if g.name in use and g.capacity), default=0.0)
        return (off, disk, hops, round(util, 4))

    def balanced(self, order_comps: list[ComponentInput], gpu_order: list[Device], prefer_whole: bool,
                 zero_first: bool = False):
        """Smallest common fraction of capacity that holds everything with no offload: (cand, use) or None."""
        zeroed = self.gpus[0].name if zero_first and gpu_order else None
        cand, use = self.refill(_FillSpec(order_comps, gpu_order, _limits_at(self.full, 1.0, zeroed), prefer_whole))
        if use is None or self.score(cand.maps, use)[0]:
            return None
        low, high, best = 0.0, 1.0, (cand, use)
        for _ in range(14):
            mid = (low + high) / 2
            cand, use = self.refill(_FillSpec(order_comps, gpu_order, _limits_at(self.full, mid, zeroed), prefer_whole))
            if use is not None and self.score(cand.maps, use)[0] == 0:
                high, best = mid, (cand, use)
            else:
                low = mid
        return best

    def greedy(self) -> list[_Tried]:
        """Auto's fills that fit, best score first: every GPU order (all of up to 4 GPUs), execution and
        largest-first component orders, split or whole-first, with and without skipping."""
        comps, gpus, offload = self.comps, self.gpus, self.offload
        exec_order = list(comps)
        largest_first = sorted(comps, key=lambda c: -c.weights_bytes)
        orders = list(itertools.permutations(gpus)) if len(gpus) <= 4 else [tuple(gpus), tuple(reversed(gpus))]
        comp_orders = [exec_order] if len(comps) == 1 else [exec_order, largest_first]
        tried = []
        for gpu_order in orders:
            for order_comps in comp_orders:
                for prefer_whole in (False, True):
                    for skip in ((False, True) if offload else (False,)):
                        spec = _FillSpec(order_comps, list(gpu_order), self.full, prefer_whole, skip)
                        cand, use = self.refill(spec)
                        if use is not None:
                            tried.append(_Tried(self.score(cand.maps, use), spec, cand, use))
        tried.sort(key=lambda item: item.score)
        return tried

    def refined(self, greedy: list[_Tried]) -> list:
        """The balanced cut of (up to four of) the best greedy fills, when the best offloads nothing and
        they tie with it on offload and hops: the most even of them wins on the score's last part."""
        results = []
        if greedy and greedy[0].score[0] == 0:
            best_key = greedy[0].score[:3]
            tried = 0
            for item in greedy:
                if item.score[:3] != best_key or tried >= 4:
                    continue
                tried += 1
                got = self.balanced(item.spec.comps, item.spec.gpu_order, item.spec.prefer_whole)
                if got:
                    results.append(got)
        return results

    def candidates(self, strategy: str) -> list:
        """(cand, use) pairs a strategy proposes; use None for one that does not fit."""
        exec_order = list(self.comps)
        gpus, full = self.gpus, self.full
        if strategy == Strategy.SEQUENTIAL:
            return [self.refill(_FillSpec(exec_order, gpus, full, False))]
        if strategy == Strategy.BALANCED:
            got = self.balanced(exec_order, gpus, False)
            return [got if got else self.refill(_FillSpec(exec_order, gpus, full, False))]
        if strategy == Strategy.BALANCED_LOW_0:
            order = gpus[1:] + gpus[:1]
            got = self.balanced(exec_order, order, False, zero_first=True) if len(gpus) > 1 else None
            if got is None:
                got = self.balanced(exec_order, order, False)
            return [got if got else self.refill(_FillSpec(exec_order, order, full, False))]
        # auto: search device orders, fill styles and component orders; keep the best score
        greedy = self.greedy()
        return [(item.cand, item.use) for item in greedy[:1]] + self.refined(greedy)

    def best(self, strategy: str):
        """The best-scoring candidate that fits: (maps, use); the all-cpu placement as last resort, or NoFit."""
        ok = [(self.score(c.maps, u), c, u) for c, u in self.candidates(strategy) if u is not None]
        if not ok and self.offload:  # last resort: run on the cpu (activations there, no GPU reserve)
            cand, use = self.refill(_FillSpec(list(self.comps), [], {}, False))
            if use is not None:
                ok = [(self.score(cand.maps, use), cand, use)]
        if not ok:
            raise _no_fit(self.comps, self.devices, strategy)
        ok.sort(key=lambda item: item[0])
        _, cand, use = ok[0]
        return cand.maps, use


def _place_residency(comps: list[ComponentInput], devices: list[Device], strategy: str):
    """Best placement of components loaded together. Returns (maps, use) or raises NoFit. Components with a
    `fixed_map` keep it; the others are placed in the room they leave."""
    fixed = [c for c in comps if c.fixed_map is not None]
    if not fixed:
        return _ResidencySearch(comps, devices).best(strategy)
    by_name = {d.name: d for d in devices}
    maps = {c.name: dict(c.fixed_map) for c in fixed}
    use = _evaluate(fixed, maps, by_name)
    rest = [c for c in comps if c.fixed_map is None]
    if rest and _fits(use, by_name):
        room = [replace(d, capacity=max(0, d.capacity - use[d.name].peak), overhead=0)
                if d.name in use and d.capacity is not None else d for d in devices]
        maps.update(_ResidencySearch(rest, room).best(strategy)[0])
        use = _evaluate(comps, maps, by_name)
    if not _fits(use, by_name):
        raise _no_fit(comps, devices, strategy)
    return maps, use


def _no_fit(comps: list[ComponentInput], devices: list[Device], strategy: str) -> NoFit:
    """Describe a failure: what is needed versus what the devices offer."""
    need_weights = sum(c.weights_bytes for c in comps)
    gpus = [d for d in devices if d.is_gpu]
    others = [d for d in devices if not d.is_gpu]
    room = sum(max(0, (d.capacity or 0) - d.overhead) for d in gpus)
    room += sum(d.capacity if d.capacity is not None else need_weights for d in others)
    largest_act = max((max(c.activation_peak, max((b.activation for b in c.blocks), default=0)) for c in comps),
                      default=0)
    shortfall = {}
    for d in gpus:
        biggest = max((b.bytes for c in comps for b in c.blocks), default=0)
        if d.capacity is not None and d.capacity < d.overhead + biggest:
            shortfall[d.name] = d.overhead + biggest - d.capacity
    missing = max(0, need_weights + largest_act - room)
    names = ", ".join(c.name for c in comps)
    return NoFit(
        f"{names} need {need_weights} bytes of weights and up to {largest_act} bytes of activations",
        shortfall, missing,
    )


def _expand(comp: ComponentInput, comp_map: dict[str, int | str]) -> dict[str, int | str]:
    """Blocks merged from several modules give one device_map entry per module."""
    if "" in comp_map and len(comp_map) == 1:
        return dict(comp_map)
    out: dict[str, int | str] = {}
    for block in comp.blocks:
        for key in block.keys:
            out[key] = comp_map[block.name]
    main = next((device for device in out.values() if device not in ("cpu", "disk")), "cpu")
    for block in comp.blocks:
        for key in block.weightless:  # a hook that moves inputs: where the block computes, offloaded or not
            out[key] = main if comp_map[block.name] in ("cpu", "disk") else comp_map[block.name]
    return out


def _together_note(stage: Stage) -> str:
    return f"{' and '.join(stage.components)} resident together" if stage.exclusive else ""


class _Pipeline:
    """One `plan_pipeline` call: its components, stages and devices, planned resident or staged.

    A residency is (stage or sub-stage, the maps of its components, its note), in run order. A component
    may serve several stages (a VAE that encodes before the denoiser and decodes after it): it has one
    device map, loaded once when resident, loaded again for each of its stages when staged.
    """

    def __init__(self, components: list[ComponentInput], stages: list[Stage], devices: list[Device],
                 strategy: str):
        self.components = components
        self.stages = stages
        self.devices = devices
        self.strategy = strategy
        self.by_comp = {c.name: c for c in components}
        self.by_dev = {d.name: d for d in devices}

    def place(self, comps: list[ComponentInput]) -> dict[str, dict[str, int | str]]:
        return _place_residency(comps, self.devices, self.strategy)[0]

    def offloaded(self, residencies: list[tuple[Stage, dict, str]]) -> int:
        return sum(_offloaded(self.by_comp[n], maps[n], self.by_dev)[0]
                   for stage, maps, _ in residencies for n in stage.components)

    def resident(self) -> Placement:
        """Every component loaded at once, for the whole run."""
        ordered = [self.by_comp[n] for n in dict.fromkeys(n for stage in self.stages for n in stage.components)]
        maps = self.place(ordered)
        return self.finish("resident", [(stage, maps, _together_note(stage)) for stage in self.stages], [])

    def staged(self) -> Placement:
        """Each stage's components loaded for that stage only; an exclusive stage's as `exclusive` decides."""
        residencies, notes = [], []
        for stage in self.stages:
            placed = {n: maps[n] for _, maps, _ in residencies for n in maps}
            if any(n in placed for n in stage.components):
                residencies.append((stage, self.around(stage, placed), ""))
                continue
            if not stage.exclusive:
                residencies.append((stage, self.place([self.by_comp[n] for n in stage.components]), ""))
                continue
            chosen, note = self.exclusive(stage)
            residencies.extend(chosen)
            if note:
                notes.append(note)
        return self.finish("staged", residencies, notes)

    def exclusive(self, stage: Stage) -> tuple[list[tuple[Stage, dict, str]], str]:
        """An exclusive stage's residencies and a warning: both components loaded at once when that offloads
        nothing (no reload at the switch), else whichever of at once and one at a time offloads less."""
        try:
            together = [(stage, self.place([self.by_comp[n] for n in stage.components]), _together_note(stage))]
        except NoFit:
            together = None
        if together is not None and self.offloaded(together) == 0:
            return together, ""
        try:
            parts = self.one_at_a_time(stage)
        except NoFit:
            if together is None:
                raise
            return together, ""
        if together is not None and self.offloaded(parts) >= self.offloaded(together):
            return together, ""
        return parts, (f"{' and '.join(stage.components)} do not fit together: they are loaded one at a time, "
                       f"{stage.components[0]} freed before {stage.components[1]} loads.")

    def around(self, stage: Stage, placed: dict[str, dict]) -> dict[str, dict]:
        """A stage with components an earlier stage placed: those keep their maps (one map per component), the
        others are placed in the room the kept ones leave (their whole peak taken from each device they use)."""
        kept = [self.by_comp[n] for n in stage.components if n in placed]
        maps = {c.name: placed[c.name] for c in kept}
        rest = [self.by_comp[n] for n in stage.components if n not in placed]
        if rest:
            use = _evaluate(kept, maps, self.by_dev)
            room = [replace(d, capacity=max(0, d.capacity - use[d.name].peak), overhead=0)
                    if d.name in use and d.capacity is not None else d for d in self.devices]
            maps.update(_place_residency(rest, room, self.strategy)[0])
        comps = [self.by_comp[n] for n in stage.components]
        if not _fits(_evaluate(comps, maps, self.by_dev), self.by_dev):
            raise _no_fit(comps, self.devices, self.strategy)
        return maps

    def one_at_a_time(self, stage: Stage) -> list[tuple[Stage, dict, str]]:
        """An exclusive stage as consecutive sub-stages: each loads after the previous one is freed."""
        parts = []
        for index, name in enumerate(stage.components):
            maps = self.place([self.by_comp[name]])
            note = (f"loads after {stage.components[index - 1]} is freed at the switch" if index
                    else f"freed at the switch, before {stage.components[1]} loads")
            parts.append((replace(stage, components=(name,), exclusive=False), maps, note))
        return parts

    def stage_use(self, kind: str, stage: Stage, maps: dict[str, dict]) -> dict[str, DeviceUse]:
        """Per-device use during a stage: resident keeps every component's weights loaded, but only this
        stage's components run (activations, reserves); staged loads only this stage's components."""
        comps = [self.by_comp[n] for n in stage.components]
        if kind != Mode.RESIDENT:
            return _evaluate(comps, maps, self.by_dev)
        use = _evaluate(self.components, maps, self.by_dev)
        acts = _evaluate(comps, maps, self.by_dev)
        for key, entry in use.items():
            entry.activations = acts[key].activations if key in acts else 0
            entry.reserve = acts[key].reserve if key in acts else 0
        return use

    def component_placement(self, comp: ComponentInput, maps: dict[str, dict]) -> ComponentPlacement:
        comp_map = _expand(comp, maps[comp.name])
        alone = _evaluate([comp], maps, self.by_dev)
        off, disk = _offloaded(comp, maps[comp.name], self.by_dev)
        stages = tuple(dict.fromkeys(stage.name for stage in self.stages if comp.name in stage.components))
        return ComponentPlacement(
            comp.name, comp.cls, comp.weights_bytes, comp_map, _exec_device(comp_map, self.by_dev),
            {k: v.activations for k, v in alone.items() if v.activations}, off,
            _hops(comp, maps[comp.name], self.by_dev), stages[0] if stages else "", disk,
            stages if len(stages) > 1 else (),
        )

    def finish(self, kind: str, residencies: list[tuple[Stage, dict, str]], notes: list[str]) -> Placement:
        """The Placement of these residencies, warning of any component that runs on no GPU."""
        maps: dict[str, dict] = {}
        for _, comp_maps, _ in residencies:
            maps.update(comp_maps)
        stage_out = [StagePlacement(stage.name, list(stage.components), self.stage_use(kind, stage, maps), note,
                                    stage.consumes, stage.produces)
                     for stage, _, note in residencies]
        placements = {comp.name: self.component_placement(comp, maps) for comp in self.components}
        gpu_names = {d.name for d in self.devices if d.is_gpu}
        for name, placed in placements.items():
            if gpu_names and not any(str(d) in gpu_names for d in placed.device_map.values()):
                unlisted = "" if any(d.name == "cpu" for d in self.devices) else (
                    " Its weights stay where they are placed, but it computes in host RAM that --max-memory does not "
                    "list, outside any budget: add cpu=SIZE, or give a GPU more memory.")
                notes.append(f"{name} fits no GPU with its activations: it runs on the cpu (slow).{unlisted}")
        return Placement(kind, self.strategy, placements, stage_out, list(notes))


def plan_pipeline(components: list[ComponentInput], stages: list[Stage], devices: list[Device],
                  strategy: str = "auto", mode: str = "auto") -> Placement:
    """Place every component for the given stages; raise NoFit when no placement fits.

    Auto mode plans resident (nothing reloads between stages) and keeps it when it offloads nothing,
    else the one of resident and staged that offloads less.
    """
    if strategy not in Strategy.words():
        raise ValueError(f"unknown strategy {strategy}")
    if mode not in Mode.words():
        raise ValueError(f"unknown mode {mode}")
    pipeline = _Pipeline(components, stages, devices, strategy)
    if mode == Mode.RESIDENT:
        return pipeline.resident()
    if mode == Mode.STAGED:
        return pipeline.staged()
    try:
        plan = pipeline.resident()
        if plan.offloaded_bytes == 0:
            return plan
    except NoFit:
        plan = None
    try:
        other = pipeline.staged()
    except NoFit:
        if plan is None:
            raise
        return plan
    if plan is None or other.offloaded_bytes < plan.offloaded_bytes:
        return other
    return plan
