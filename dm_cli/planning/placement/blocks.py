"""A component as the search sees it: atomic blocks (device_map keys) in execution order, cut from its module
tree by `component_blocks`, and the checks of a device map against its tensors (`coverage_problems`,
`clean_device_map`). Pure: no torch, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, replace

from dm_cli.devices import covers


@dataclass(frozen=True)
class Block:
    """An atomic unit of placement: one device_map key (module prefix, or a tensor name)."""

    name: str
    bytes: int
    activation: int = 0  # peak live activation bytes while this block runs (from the meta trace)
    extra_keys: tuple[str, ...] = ()  # more device_map keys that must share this block's device
    # modules without tensors whose output this block's module combines (LTX-2's norm_out): each gets a
    # device_map key on this block's execution device, so that accelerate's hook moves its inputs there
    weightless: tuple[str, ...] = ()

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
    # block name -> device, decided before the search (pipeline parallel's cut): never searched, only checked,
    # the other components placed in the room it leaves
    fixed_map: dict[str, int | str] | None = None

    @property
    def weights_bytes(self) -> int:
        return sum(b.bytes for b in self.blocks)


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
    tree = _ModuleTree.of(modules, tensor_bytes)
    found: list[tuple[str, int]] = []
    _collect_atomic(tree, "", set(no_split_classes), set(unsplittable), found)
    warnings: list[str] = []
    if execution_order:
        position: dict[str, int] = {}
        for index, prefix in enumerate(execution_order):
            position.setdefault(prefix, index)
        registration = {name: i for i, (name, _) in enumerate(found)}
        order = sorted(found, key=lambda item: (_first_call(item[0], tree.cls_of, position), registration[item[0]]))
        never = [name for name, _ in found if _first_call(name, tree.cls_of, position) == float("inf")]
        if never:
            shown = ", ".join(never[:4]) + (", …" if len(never) > 4 else "")
            warnings.append(f"{len(never)} block(s) never ran in the trace ({shown}): placed after the others.")
    else:
        order = found
    peaks = module_peaks or {}
    blocks = [Block(name, nbytes, _peak_of(name, peaks)) for name, nbytes in order]
    blocks = _tie_aliases(blocks, tie_groups)
    root_tensors = {name for name, _ in tree.direct.get("", [])} if tree.children[""] else set()
    weightless = {prefix for prefix in tree.cls_of if prefix and prefix not in tree.subtree_bytes}
    return _merge_groups(blocks, same_device_groups or {}, root_tensors, weightless), warnings


def _enclosing(name: str, modules) -> str:
    """The nearest module in `modules` that encloses a dotted name ("" for the root)."""
    parent = name.rpartition(".")[0]
    while parent not in modules and parent:
        parent = parent.rpartition(".")[0]
    return parent


@dataclass
class _ModuleTree:
    """A skeleton's modules: children, class, the tensors each holds directly, the bytes below each one."""

    children: dict[str, list[str]]
    cls_of: dict[str, str]
    direct: dict[str, list[tuple[str, int]]]
    subtree_bytes: dict[str, int]  # only modules with tensors below them

    @classmethod
    def of(cls, modules: list[tuple[str, str]], tensor_bytes: list[tuple[str, int]]) -> _ModuleTree:
        children: dict[str, list[str]] = {prefix: [] for prefix, _ in modules}
        children.setdefault("", [])
        for prefix in children:
            if prefix:
                children[_enclosing(prefix, children)].append(prefix)
        direct: dict[str, list[tuple[str, int]]] = {}
        subtree_bytes: dict[str, int] = {}
        for name, nbytes in tensor_bytes:
            owner = _enclosing(name, children)
            direct.setdefault(owner, []).append((name, nbytes))
            prefix = owner
            while True:
                subtree_bytes[prefix] = subtree_bytes.get(prefix, 0) + nbytes
                if not prefix:
                    break
                prefix = _enclosing(prefix, children)
        return cls(children, dict(modules), direct, subtree_bytes)


def _collect_atomic(tree: _ModuleTree, prefix: str, no_split: set[str], unsplit: set[str],
                    found: list[tuple[str, int]]) -> None:
    """Append the atomic blocks under `prefix` to `found`, in registration order: a module stops the walk
    when it is a no-split class, unsplittable, a leaf, or holds tensors itself; the root's own tensors
    (when it has children) become entries of their own."""
    holds = tree.subtree_bytes.get(prefix, 0)
    if prefix not in tree.subtree_bytes:
        return  # no tensors below: nothing to place
    kids = [c for c in tree.children[prefix] if c in tree.subtree_bytes]
    atomic = tree.cls_of.get(prefix) in no_split or prefix in unsplit or not kids or (prefix and prefix in tree.direct)
    if prefix and atomic:
        found.append((prefix, holds))
        return
    if not prefix and (not kids or "" in unsplit):
        found.append(("", holds))
        return
    for name, nbytes in tree.direct.get(prefix, []):  # root's own tensors
        found.append((name, nbytes))
    for child in kids:
        _collect_atomic(tree, child, no_split, unsplit, found)


def _first_call(block: str, cls_of: dict[str, str], position: dict[str, int]) -> float:
    """When a block first runs (its index in the execution order; inf when never): its own first call or
    any of its submodules'; a tensor entry of the root runs when its owner starts (the root: first)."""
    if block not in cls_of:  # a tensor held by a module that has children: when its owner starts
        owner = block.rpartition(".")[0]
        return -1 if not owner else position.get(owner, float("inf"))
    best = position.get(block, float("inf"))
    dotted = block + "."
    for prefix, index in position.items():
        if index < best and prefix.startswith(dotted):
            best = index
    return best


def _peak_of(block: str, peaks: dict[str, int]) -> int:
    """A block's activation peak: its own from the trace, else the largest of its submodules' (0 if none)."""
    if block in peaks:
        return peaks[block]
    dotted = block + "."
    inside = [v for k, v in peaks.items() if k.startswith(dotted)]
    return max(inside) if inside else 0


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


def _merge_groups(blocks: list[Block], groups: dict[str, list[list[str]]],
                  root_tensors: set[str] | frozenset = frozenset(),
                  weightless: set[str] | frozenset = frozenset()) -> list[Block]:
    """Children that a split module's forward combines must share a device: merge their run of blocks.

    In the root's groups, the root itself ("": its inputs and own tensors) stands for the root's own
    tensor entries (`root_tensors`): LTX-2 adds its scale_shift_table to time_embed's output, so the two
    share a device. A member without tensors (`weightless`: LTX-2's norm_out, whose output the root
    modulates with them) is no block: it joins the group's block as a hook on that block's device."""
    names = [b.name for b in blocks]

    def index_of(member: str) -> int | None:
        for i, name in enumerate(names):
            if name == member or name.startswith(member + ".") or member.startswith(name + ".") or not name:
                return i
        return None

    spans: list[tuple[int, int]] = []
    hooks: dict[int, list[str]] = {}  # block index -> weightless members to hook on its device
    for parent, parent_groups in groups.items():
        if any(parent == n or parent.startswith(n + ".") for n in names if n):
            continue  # the parent is inside one block already
        for group in parent_groups:
            members = [m for m in group if m != parent]
            indices = [i for i in (index_of(m) for m in members if m not in weightless) if i is not None]
            if not parent and "" in group:
                indices += [i for i, name in enumerate(names) if name in root_tensors]
            if indices:
                for member in members:
                    if member in weightless and member not in hooks.get(min(indices), []):
                        hooks.setdefault(min(indices), []).append(member)
            if len(set(indices)) > 1:
                spans.append((min(indices), max(indices)))
    blocks = [replace(b, weightless=(*b.weightless, *hooks[i])) if i in hooks else b for i, b in enumerate(blocks)]
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
        out.append(Block(keys[0], sum(b.bytes for b in run), max(b.activation for b in run), keys[1:],
                         tuple(w for b in run for w in b.weightless)))
        cursor = end + 1
    out.extend(blocks[cursor:])
    return out


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
