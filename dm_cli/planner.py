"""The pure planner: (component blocks with bytes and activations, stages, devices, strategy, mode) -> placement.

No torch, no I/O. Everything here is plain data so that planning is fast, cacheable and testable by
hand. `plans.py` turns skeletons and meta traces into the inputs and the result into a Plan.

Model of memory on a device during a stage:
    weights of every block placed there
  + the offload reserve (largest cpu/disk block streamed to it, when something is offloaded)
  + the largest activation of any component running there (components in a stage run one after another)
  + the per-device overhead (CUDA context, allocator slack), once the device is used.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .devices import covers

STRATEGIES = ("auto", "sequential", "balanced", "balanced_low_0")
MODES = ("auto", "resident", "staged")


# --- inputs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """An atomic unit of placement: one device_map key (module prefix, or a tensor name)."""

    name: str
    bytes: int
    activation: int = 0  # peak live activation bytes while this block runs (from the meta trace)
    extra_keys: tuple[str, ...] = ()  # more device_map keys that must share this block's device

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.name, *self.extra_keys)


@dataclass
class ComponentInput:
    name: str
    cls: str
    blocks: list[Block]  # in execution order; together they cover every tensor once
    splittable: bool = True  # False: the whole component goes to one device (the VAE)
    activation_peak: int = 0  # peak of the whole forward (charged when the component sits on one device)
    io_bytes: int = 0  # inputs + outputs, held by the devices running the first and last block

    @property
    def weights_bytes(self) -> int:
        return sum(b.bytes for b in self.blocks)


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


@dataclass(frozen=True)
class Stage:
    name: str
    components: tuple[str, ...]
    # The components run one after another and never together (Wan 2.2's two experts, switched at a
    # boundary step): the planner may load them one at a time, as consecutive sub-stages of this stage.
    exclusive: bool = False


# --- outputs --------------------------------------------------------------------------------------


@dataclass
class ComponentPlacement:
    name: str
    cls: str
    weights_bytes: int
    device_map: dict[str, int | str]  # execution order; {"": d} when whole
    execution_device: int | str  # where offloaded blocks run (accelerate's main device)
    activation_by_device: dict[str, int]
    offloaded_bytes: int  # on cpu or disk
    hops: int  # device changes along the execution path
    stage: str
    disk_bytes: int = 0

    @property
    def devices(self) -> list[int | str]:
        seen: list[int | str] = []
        for device in self.device_map.values():
            if device not in seen:
                seen.append(device)
        return seen

    @property
    def is_split(self) -> bool:
        return len(self.device_map) > 1


@dataclass
class DeviceUse:
    weights: int = 0
    reserve: int = 0
    activations: int = 0
    overhead: int = 0

    @property
    def peak(self) -> int:
        return self.weights + self.reserve + self.activations + self.overhead


@dataclass
class StagePlacement:
    name: str
    components: list[str]
    use: dict[str, DeviceUse]  # device name -> breakdown (only devices used in this stage)
    note: str = ""  # how this stage's components are loaded, when that is not obvious (experts)

    @property
    def peak_bytes(self) -> dict[str, int]:
        return {device: use.peak for device, use in self.use.items()}


@dataclass
class Placement:
    mode: str  # resident or staged
    strategy: str
    components: dict[str, ComponentPlacement]
    stages: list[StagePlacement]
    warnings: list[str] = field(default_factory=list)

    @property
    def offloaded_bytes(self) -> int:
        return sum(c.offloaded_bytes for c in self.components.values())

    @property
    def disk_bytes(self) -> int:
        return sum(c.disk_bytes for c in self.components.values())

    @property
    def hops(self) -> int:
        return sum(c.hops for c in self.components.values())


class NoFit(Exception):
    """Raised by the pure planner: nothing placed every block within the capacities."""

    def __init__(self, message: str, shortfall: dict[str, int], unplaced_bytes: int):
        super().__init__(message)
        self.shortfall = shortfall
        self.unplaced_bytes = unplaced_bytes


# --- atomic blocks from a skeleton ------------------------------------------------------------------


def component_blocks(
    modules: list[tuple[str, str]],
    tensor_bytes: list[tuple[str, int]],
    no_split_classes: list[str],
    execution_order: list[str] | None = None,
    unsplittable: list[str] | tuple = (),
    module_peaks: dict[str, int] | None = None,
    same_device_groups: dict[str, list[list[str]]] | None = None,
    tie_groups: list[list[str]] | tuple = (),
) -> tuple[list[Block], list[str]]:
    """Cut a module tree into atomic blocks, ordered by first execution.

    A block is a module that is a no-split class, or reported unsplittable by the trace, or holds
    tensors itself (a leaf such as conv_in, or a module mixing own tensors with children). Tensors held
    directly by the root when it has children become entries of their own (tensor name keys).
    Returns (blocks, warnings).
    """
    children: dict[str, list[str]] = {prefix: [] for prefix, _ in modules}
    children.setdefault("", [])
    cls_of = dict(modules)
    for prefix in children:
        if prefix:
            parent = prefix.rpartition(".")[0]
            while parent not in children and parent:
                parent = parent.rpartition(".")[0]
            children[parent].append(prefix)
    direct: dict[str, list[tuple[str, int]]] = {}
    subtree_bytes: dict[str, int] = {}
    for name, nbytes in tensor_bytes:
        owner = name.rpartition(".")[0]
        while owner not in children and owner:
            owner = owner.rpartition(".")[0]
        direct.setdefault(owner, []).append((name, nbytes))
        prefix = owner
        while True:
            subtree_bytes[prefix] = subtree_bytes.get(prefix, 0) + nbytes
            if not prefix:
                break
            parent = prefix.rpartition(".")[0]
            while parent not in children and parent:
                parent = parent.rpartition(".")[0]
            prefix = parent
    no_split = set(no_split_classes)
    unsplit = set(unsplittable)
    found: list[tuple[str, int]] = []
    warnings: list[str] = []

    def walk(prefix: str) -> None:
        holds = subtree_bytes.get(prefix, 0)
        if prefix not in subtree_bytes:
            return  # no tensors below: nothing to place
        kids = [c for c in children[prefix] if c in subtree_bytes]
        atomic = cls_of.get(prefix) in no_split or prefix in unsplit or not kids or (prefix and prefix in direct)
        if prefix and atomic:
            found.append((prefix, holds))
            return
        if not prefix and (not kids or "" in unsplit):
            found.append(("", holds))
            return
        for name, nbytes in direct.get(prefix, []):  # root's own tensors
            found.append((name, nbytes))
        for child in kids:
            walk(child)

    walk("")
    position: dict[str, int] = {}
    if execution_order:
        for index, prefix in enumerate(execution_order):
            position.setdefault(prefix, index)

    def first_call(block: str) -> float:
        if block not in cls_of:  # a tensor held by a module that has children: when its owner starts
            owner = block.rpartition(".")[0]
            return -1 if not owner else position.get(owner, float("inf"))
        best = position.get(block, float("inf"))
        dotted = block + "."
        for prefix, index in position.items():
            if index < best and prefix.startswith(dotted):
                best = index
        return best

    registration = {name: i for i, (name, _) in enumerate(found)}
    if execution_order:
        order = sorted(found, key=lambda item: (first_call(item[0]), registration[item[0]]))
        never = [name for name, _ in found if first_call(name) == float("inf")]
        if never:
            shown = ", ".join(never[:4]) + (", …" if len(never) > 4 else "")
            warnings.append(f"{len(never)} block(s) never ran in the trace ({shown}): placed after the others.")
    else:
        order = found
    peaks = module_peaks or {}

    def peak_of(block: str) -> int:
        if block in peaks:
            return peaks[block]
        dotted = block + "."
        inside = [v for k, v in peaks.items() if k.startswith(dotted)]
        return max(inside) if inside else 0

    blocks = [Block(name, nbytes, peak_of(name)) for name, nbytes in order]
    blocks = _tie_aliases(blocks, tie_groups)
    return _merge_groups(blocks, same_device_groups or {}), warnings


def _covering(blocks: list[Block], tensor: str) -> int | None:
    for index, block in enumerate(blocks):
        for key in block.keys:
            if covers(key, tensor):
                return index
    return None


def _tie_aliases(blocks: list[Block], tie_groups) -> list[Block]:
    """Tied aliases (T5's encoder.embed_tokens = shared) get a device_map key on their kept tensor's block."""
    blocks = list(blocks)
    for group in tie_groups:
        kept = _covering(blocks, group[0])
        if kept is None:
            continue
        for alias in group[1:]:
            if _covering(blocks, alias) is not None:
                continue
            owner = alias.rpartition(".")[0] or alias
            block = blocks[kept]
            blocks[kept] = Block(block.name, block.bytes, block.activation, (*block.extra_keys, owner))
    return blocks


def _merge_groups(blocks: list[Block], groups: dict[str, list[list[str]]]) -> list[Block]:
    """Children that a split module's forward combines must share a device: merge their run of blocks."""
    names = [b.name for b in blocks]

    def index_of(member: str) -> int | None:
        for i, name in enumerate(names):
            if name == member or name.startswith(member + ".") or member.startswith(name + ".") or not name:
                return i
        return None

    spans: list[tuple[int, int]] = []
    for parent, parent_groups in groups.items():
        if any(parent == n or parent.startswith(n + ".") for n in names if n):
            continue  # the parent is inside one block already
        for group in parent_groups:
            members = [m for m in group if m != parent]
            indices = [i for i in (index_of(m) for m in members) if i is not None]
            if len(set(indices)) > 1:
                spans.append((min(indices), max(indices)))
    if not spans:
        return blocks
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    out: list[Block] = []
    cursor = 0
    for start, end in merged:
        out.extend(blocks[cursor:start])
        run = blocks[start:end + 1]
        keys = tuple(k for b in run for k in b.keys)
        out.append(Block(keys[0], sum(b.bytes for b in run), max(b.activation for b in run), keys[1:]))
        cursor = end + 1
    out.extend(blocks[cursor:])
    return out


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


def _fill(comps: list[ComponentInput], gpu_order: list[Device], limits: dict[str, int],
          offload: list[Device], reserves: dict[str, int], prefer_whole: bool, skip: bool = False) -> _Cand:
    """Contiguous fill in execution order: GPUs in `gpu_order` up to `limits`, then cpu, then disk.

    The cursor never returns to an earlier GPU within a component; a non-splittable component goes
    whole to the first GPU (from the cursor) with room. `reserves` pre-charges offload reserves.
    With `skip`, a block that misses the last GPU is offloaded alone and later blocks still try it.
    """
    weights = {d.name: 0 for d in gpu_order}
    acts: dict[str, int] = {d.name: 0 for d in gpu_order}
    used = {d.name: False for d in gpu_order}
    off_free = {d.name: d.capacity for d in offload}
    maps: dict[str, dict[str, int | str]] = {}
    unplaced = 0

    def room(device: Device, add_weights: int, add_act: int) -> bool:
        key = device.name
        total = weights[key] + add_weights + reserves.get(key, 0) + max(acts[key], add_act) + device.overhead
        return total <= limits[key]

    def take(device: Device, add_weights: int, add_act: int) -> None:
        weights[device.name] += add_weights
        acts[device.name] = max(acts[device.name], add_act)
        used[device.name] = True

    def offload_whole_or_block(nbytes: int):
        for device in offload:
            free = off_free[device.name]
            if free is None or free >= nbytes:
                if free is not None:
                    off_free[device.name] = free - nbytes
                return device.key
        return None

    cursor = 0
    for comp in comps:
        whole_act = max(comp.activation_peak, comp.io_bytes, max((b.activation for b in comp.blocks), default=0))
        total = comp.weights_bytes
        if not comp.splittable or prefer_whole:
            candidates = gpu_order[cursor:] if not prefer_whole else gpu_order
            fitting = [d for d in candidates if room(d, total, whole_act)]
            if fitting:
                if prefer_whole:  # best fit: the GPU left with the least room
                    device = min(fitting, key=lambda d: limits[d.name] - weights[d.name])
                else:
                    device = fitting[0]
                take(device, total, whole_act)
                maps[comp.name] = {"": device.key}
                if not prefer_whole:
                    cursor = gpu_order.index(device)
                continue
            if not comp.splittable:
                target = offload_whole_or_block(total)
                if target is None:
                    unplaced += total
                    target = offload[-1].key if offload else "cpu"
                maps[comp.name] = {"": target}
                continue
        comp_map: dict[str, int | str] = {}
        comp_acts: dict[str, int] = {}
        gpu_keys = {d.key for d in gpu_order}
        for index, block in enumerate(comp.blocks):
            placed = False
            while cursor < len(gpu_order):
                device = gpu_order[cursor]
                act = block.activation
                if comp.io_bytes and (index == 0 or index == len(comp.blocks) - 1):
                    act = max(act, comp.io_bytes)
                if index == len(comp.blocks) - 1 and not any(
                        d in gpu_keys and d != device.key for d in comp_map.values()):
                    # the last block here runs the whole component on this GPU: charge its forward's peak
                    # (as _evaluate will), or the fill must cut before it
                    act = max(act, whole_act)
                if room(device, block.bytes, act):
                    take(device, block.bytes, act)
                    comp_map[block.name] = device.key
                    comp_acts[device.name] = max(comp_acts.get(device.name, 0), act)
                    placed = True
                    break
                if skip and cursor == len(gpu_order) - 1:
                    break
                cursor += 1
            if not placed:
                target = offload_whole_or_block(block.bytes)
                if target is None:
                    unplaced += block.bytes
                    target = offload[-1].key if offload else "cpu"
                comp_map[block.name] = target
        if all(not isinstance(d, int) and d != "mps" for d in comp_map.values()) and len(set(comp_map.values())) == 1:
            comp_map = {"": next(iter(comp_map.values()))}
        elif len(set(comp_map.values())) == 1:
            comp_map = {"": next(iter(comp_map.values()))}
        maps[comp.name] = comp_map
    return _Cand(maps, unplaced)


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


def _place_residency(comps: list[ComponentInput], devices: list[Device], strategy: str):
    """Best placement of components loaded together. Returns (maps, use) or raises NoFit."""
    by_name = {d.name: d for d in devices}
    gpus = [d for d in devices if d.is_gpu]
    offload = [d for d in devices if not d.is_gpu]
    if not gpus and "cpu" in by_name:
        # no GPU: the cpu computes (weights, activations, the reserve for streaming) and disk holds the rest
        gpus, offload = [by_name["cpu"]], [d for d in offload if d.key == "disk"]
    full = {d.name: d.capacity for d in gpus}

    def run(order_comps, gpu_order, limits, prefer_whole, skip=False):
        """Fill, then re-fill with offload reserves until they settle; None when it does not fit.

        A refill charges what the fill could not see (the streaming reserve, activations of offloaded
        blocks run on their execution GPU, the excess over capacity) as a reserve. When that leaves the
        fill unchanged (the excess is smaller than the block that must move), the excess is charged
        the smallest whole number of times that changes the fill (doubling, then bisecting): a tiny
        excess takes few fills, and no more blocks move than charging it repeatedly would move.
        """
        def fill(res):
            return _fill(order_comps, gpu_order, limits, offload, res, prefer_whole, skip)

        def grown(res, use, times):
            out = dict(res)
            for key, entry in use.items():
                device = by_name[key]
                if device not in gpus:
                    continue
                want = max(res.get(key, 0), entry.reserve)
                if device.capacity is not None and entry.peak > device.capacity:
                    want = max(want, res.get(key, 0) + (entry.peak - device.capacity) * times)
                out[key] = want
            return out

        def moves(trial, cand):
            return trial.unplaced or trial.maps != cand.maps

        reserves: dict[str, int] = {}
        cand = fill(reserves)
        for _ in range(16):
            if cand.unplaced:
                return cand, None
            use = _evaluate(comps, cand.maps, by_name)
            if _fits(use, by_name):
                return cand, use
            step = grown(reserves, use, 1)
            if step == reserves:
                return cand, None
            following = fill(step)
            if not moves(following, cand):
                low, high = 1, 2
                while not moves(fill(grown(reserves, use, high)), cand):
                    if high > 1 << 40:
                        return cand, None
                    low, high = high, high * 2
                while high - low > 1:
                    middle = (low + high) // 2
                    if moves(fill(grown(reserves, use, middle)), cand):
                        high = middle
                    else:
                        low = middle
                step = grown(reserves, use, high)
                following = fill(step)
            reserves, cand = step, following
        return cand, None

    def score(maps, use):
        off = disk = hops = 0
        for comp in comps:
            o, d = _offloaded(comp, maps[comp.name], by_name)
            off, disk, hops = off + o, disk + d, hops + _hops(comp, maps[comp.name], by_name)
        util = max((use[g.name].peak / g.capacity for g in gpus if g.name in use and g.capacity), default=0.0)
        return (off, disk, hops, round(util, 4))

    def balanced(order_comps, gpu_order, prefer_whole, zero_first=False):
        """Smallest common fraction of capacity that holds everything with no offload."""
        def limits_at(fraction):
            limits = {k: int(v * fraction) for k, v in full.items()}
            if zero_first and gpu_order:
                limits[gpus[0].name] = 0
            return limits

        cand, use = run(order_comps, gpu_order, limits_at(1.0), prefer_whole)
        if use is None or score(cand.maps, use)[0]:
            return None
        low, high, best = 0.0, 1.0, (cand, use)
        for _ in range(14):
            mid = (low + high) / 2
            cand, use = run(order_comps, gpu_order, limits_at(mid), prefer_whole)
            if use is not None and score(cand.maps, use)[0] == 0:
                high, best = mid, (cand, use)
            else:
                low = mid
        return best

    results = []
    exec_order = list(comps)
    if strategy == "sequential":
        results.append(run(exec_order, gpus, full, False))
    elif strategy == "balanced":
        got = balanced(exec_order, gpus, False)
        results.append(got if got else run(exec_order, gpus, full, False))
    elif strategy == "balanced_low_0":
        order = gpus[1:] + gpus[:1]
        got = balanced(exec_order, order, False, zero_first=True) if len(gpus) > 1 else None
        if got is None:
            got = balanced(exec_order, order, False)
        results.append(got if got else run(exec_order, order, full, False))
    else:  # auto: search device orders, fill styles and component orders; keep the best score
        largest_first = sorted(comps, key=lambda c: -c.weights_bytes)
        orders = list(itertools.permutations(gpus)) if len(gpus) <= 4 else [tuple(gpus), tuple(reversed(gpus))]
        comp_orders = [exec_order] if len(comps) == 1 else [exec_order, largest_first]
        greedy = []
        for gpu_order in orders:
            for order_comps in comp_orders:
                for prefer_whole in (False, True):
                    for skip in ((False, True) if offload else (False,)):
                        cand, use = run(order_comps, list(gpu_order), full, prefer_whole, skip)
                        if use is not None:
                            greedy.append((score(cand.maps, use), list(gpu_order), order_comps, prefer_whole,
                                           cand, use))
        greedy.sort(key=lambda item: item[0])
        results.extend((item[4], item[5]) for item in greedy[:1])
        if greedy and greedy[0][0][0] == 0:
            best_key = greedy[0][0][:3]
            tried = 0
            for item in greedy:
                if item[0][:3] != best_key or tried >= 4:
                    continue
                tried += 1
                got = balanced(item[2], item[1], item[3])
                if got:
                    results.append(got)
    ok = [(score(c.maps, u), c, u) for c, u in results if u is not None]
    if not ok and offload:  # last resort: run on the cpu (activations there, no GPU reserve)
        cand, use = run(exec_order, [], {}, False)
        if use is not None:
            ok = [(score(cand.maps, use), cand, use)]
    if not ok:
        cand, _ = results[0] if results else (None, None)
        raise _no_fit(comps, devices, strategy)
    ok.sort(key=lambda item: item[0])
    _, cand, use = ok[0]
    return cand.maps, use


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
    return out


def default_stages(components: list[str], offload_seq: list[str] | None,
                   denoisers: tuple[str, ...] = ("transformer", "unet")) -> list[Stage]:
    """encode (everything before the denoiser), denoise, decode (after it), from model_cpu_offload_seq.

    `denoisers`: component names that denoise (the family's; see dm_cli.families.pipeline_stages).
    Denoisers that follow each other in the sequence (Wan 2.2's `transformer`, `transformer_2`) form one
    denoise stage whose components run one at a time (`exclusive`).
    """
    order = [c for c in (offload_seq or []) if c in components]
    order += [c for c in components if c not in order]
    denoiser_names = denoisers
    denoisers = [c for c in order if c in denoiser_names]
    if not denoisers:
        return [Stage("run", tuple(order))] if order else []
    pivot = order.index(denoisers[0])
    end = pivot + 1
    while end < len(order) and order[end] in denoiser_names:
        end += 1
    extra = [c for c in components if c not in (offload_seq or []) and "controlnet" in c]
    encode = tuple(c for c in order[:pivot] if c not in extra)
    denoise = tuple([*order[pivot:end], *extra])
    decode = tuple(c for c in order[end:] if c not in extra)
    stages = []
    if encode:
        stages.append(Stage("encode", encode))
    stages.append(Stage("denoise", denoise, exclusive=end - pivot > 1))
    if decode:
        stages.append(Stage("decode", decode))
    return stages


def plan_pipeline(components: list[ComponentInput], stages: list[Stage], devices: list[Device],
                  strategy: str = "auto", mode: str = "auto") -> Placement:
    """Place every component for the given stages; raise NoFit when no placement fits."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode}")
    by_comp = {c.name: c for c in components}
    by_dev = {d.name: d for d in devices}

    def finish(kind: str, residencies: list[tuple[Stage, dict, str]], notes: list[str]) -> Placement:
        """`residencies`: (stage or sub-stage, its maps, note), in run order."""
        placements: dict[str, ComponentPlacement] = {}
        stage_of = {name: stage.name for stage in stages for name in stage.components}
        maps: dict[str, dict] = {}
        for _, comp_maps, _ in residencies:
            maps.update(comp_maps)
        stage_out = []
        for stage, _, note in residencies:
            comps = [by_comp[n] for n in stage.components]
            if kind == "resident":
                loaded = components
                use = _evaluate(loaded, maps, by_dev)
                # activations: only this stage's components run; weights: everything stays loaded
                acts = _evaluate(comps, maps, by_dev)
                for key, entry in use.items():
                    entry.activations = acts[key].activations if key in acts else 0
                    entry.reserve = acts[key].reserve if key in acts else 0
            else:
                use = _evaluate(comps, maps, by_dev)
            stage_out.append(StagePlacement(stage.name, list(stage.components), use, note))
        for comp in components:
            comp_map = _expand(comp, maps[comp.name])
            alone = _evaluate([comp], maps, by_dev)
            off, disk = _offloaded(comp, maps[comp.name], by_dev)
            placements[comp.name] = ComponentPlacement(
                comp.name, comp.cls, comp.weights_bytes, comp_map, _exec_device(comp_map, by_dev),
                {k: v.activations for k, v in alone.items() if v.activations}, off,
                _hops(comp, maps[comp.name], by_dev), stage_of.get(comp.name, ""), disk,
            )
        gpu_names = {d.name for d in devices if d.is_gpu}
        for name, placed in placements.items():
            if gpu_names and not any(str(d) in gpu_names for d in placed.device_map.values()):
                notes.append(f"{name} fits no GPU with its activations: it runs on the cpu (slow).")
        return Placement(kind, strategy, placements, stage_out, list(notes))

    def together_note(stage: Stage) -> str:
        return f"{' and '.join(stage.components)} resident together" if stage.exclusive else ""

    def resident():
        ordered = [by_comp[n] for stage in stages for n in stage.components]
        maps, _ = _place_residency(ordered, devices, strategy)
        return finish("resident", [(stage, maps, together_note(stage)) for stage in stages], [])

    def one_at_a_time(stage: Stage) -> list[tuple[Stage, dict, str]]:
        """An exclusive stage as consecutive sub-stages: each loads after the previous one is freed."""
        parts = []
        for index, name in enumerate(stage.components):
            maps, _ = _place_residency([by_comp[name]], devices, strategy)
            note = (f"loads after {stage.components[index - 1]} is freed at the switch" if index
                    else f"freed at the switch, before {stage.components[1]} loads")
            parts.append((Stage(stage.name, (name,)), maps, note))
        return parts

    def offloaded(parts) -> int:
        return sum(_offloaded(by_comp[n], maps[n], by_dev)[0] for stage, maps, _ in parts for n in stage.components)

    def staged():
        residencies, notes = [], []
        for stage in stages:
            comps = [by_comp[n] for n in stage.components]
            if not stage.exclusive:
                maps, _ = _place_residency(comps, devices, strategy)
                residencies.append((stage, maps, ""))
                continue
            try:  # both loaded at once when that offloads nothing: no reload at the switch
                together = [(stage, _place_residency(comps, devices, strategy)[0], together_note(stage))]
            except NoFit:
                together = None
            if together is not None and offloaded(together) == 0:
                residencies.extend(together)
                continue
            try:
                parts = one_at_a_time(stage)
            except NoFit:
                if together is None:
                    raise
                parts = None
            chosen = parts if parts is not None and (together is None or offloaded(parts) < offloaded(together)) \
                else together
            residencies.extend(chosen)
            if chosen is parts:
                notes.append(f"{' and '.join(stage.components)} do not fit together: they are loaded one at a time, "
                             f"{stage.components[0]} freed before {stage.components[1]} loads.")
        return finish("staged", residencies, notes)

    if mode == "resident":
        return resident()
    if mode == "staged":
        return staged()
    try:
        plan = resident()
        if plan.offloaded_bytes == 0:
            return plan
    except NoFit:
        plan = None
    try:
        other = staged()
    except NoFit:
        if plan is None:
            raise
        return plan
    if plan is None or other.offloaded_bytes < plan.offloaded_bytes:
        return other
    return plan


# --- checks ------------------------------------------------------------------------------------------


def coverage_problems(device_map: dict[str, int | str], tensor_names: list[str]) -> list[str]:
    """Every tensor covered by exactly one device_map entry (a prefix or the tensor itself)."""
    problems = []
    keys = list(device_map)
    used = set()
    for name in tensor_names:
        matches = [k for k in keys if covers(k, name)]
        if len(matches) != 1:
            problems.append(f"{name} is covered by {len(matches)} entries" + (f" ({', '.join(matches)})" if matches else ""))
        used.update(matches)
    for key in keys:
        if key not in used:
            problems.append(f"entry '{key}' covers no tensor")
    return problems


def clean_device_map(device_map: dict[str, int | str], modules: list[str]) -> dict[str, int | str]:
    """Collapse entries whose siblings all share a device into their parent, like accelerate's clean map."""
    current = dict(device_map)
    if len(set(current.values())) == 1 and current:
        return {"": next(iter(current.values()))}
    changed = True
    while changed:
        changed = False
        parents: dict[str, list[str]] = {}
        for key in current:
            if key:
                parents.setdefault(key.rpartition(".")[0], []).append(key)
        for parent, keys in parents.items():
            if not parent:
                continue
            all_children = [m for m in modules if m.rpartition(".")[0] == parent]
            values = {current[k] for k in keys}
            if len(values) == 1 and set(keys) >= set(all_children) and parent not in current:
                value = values.pop()
                position = min(list(current).index(k) for k in keys)
                items = [(k, v) for k, v in current.items() if k not in keys]
                items.insert(position, (parent, value))
                current = dict(items)
                changed = True
                break
    return current
