"""Whether a component's offloaded blocks are fetched ahead of their turn (overlapped offload, run/load/prefetch.py) or
each in its turn (synchronous), and what the overlap costs in memory. Pure: plain data in, the plan's placement
updated.

Overlapped: while block k computes, block k+1's weights are copied from pinned host memory on a second CUDA stream,
so the execution device holds the prefetched block beside the running one (the running block's room is the offload
reserve search.py already charges; the prefetched one, the largest block the cpu holds, is added to it), and the
cpu's blocks are kept in RAM as pinned copies (the RAM search.py already charges them as the cpu's weights). The
time model (step_time.py) then counts max(compute, transfer) per block instead of their sum: never slower, so the
plan overlaps wherever the prefetched block fits. What stays synchronous: a CPU that computes (nothing to overlap
with; a VAE, which dmap places whole, offloaded is computed there, so a decode, tiled or not, never streams), an
execution device that is not CUDA (mps: no second stream dmap drives), blocks on disk (read from the checkpoint on
each use, no pinned copy), and a prefetched block that does not fit beside the running one."""

from __future__ import annotations

from dm_cli.units import format_size

OVERLAPPED = "overlapped"
SYNCHRONOUS = "synchronous"
MODES = (OVERLAPPED, SYNCHRONOUS)


def choose_overlap(plan, specs) -> None:
    """Each component that streams blocks gets its `offload` choice (`dmap plan` says it beside what it offloads);
    an overlapped one's prefetched block is added to the offload reserve of its execution device in every stage
    that runs it."""
    capacities = {d.name: d.capacity for d in plan.devices}
    for spec in specs:
        placed = plan.components.get(spec.name)
        if placed is None or not placed.offloaded_bytes:
            continue
        placed.offload = offload_choice(spec, placed, plan.stages, capacities)


def offload_choice(spec, placed, stages, capacities: dict) -> dict:
    """`placed.offload` for `spec` (its blocks, their bytes), with the stages' reserves raised where it overlaps."""
    execution = str(placed.execution_device)
    cpu_blocks = [b.bytes for b in spec.blocks if str(placed.device_map.get(b.name, placed.device_map.get(""))) == "cpu"]
    pinned, prefetch = sum(cpu_blocks), max(cpu_blocks, default=0)

    def synchronous(reason: str) -> dict:
        return {"mode": SYNCHRONOUS, "reason": reason, "prefetch_bytes": 0, "pinned_bytes": 0}

    if execution in ("cpu", "disk"):
        whole = "" if getattr(spec, "splittable", True) else "dmap places it whole (a VAE is never split, tiled or not), so "
        return synchronous(f"{whole}the cpu computes it: there is no copy to overlap with its compute")
    if not execution.isdigit():
        return synchronous(f"its execution device is {execution}: dmap prefetches on a second CUDA stream only")
    if not cpu_blocks:
        return synchronous("its offloaded blocks are on disk, read from the checkpoint on each use, with no pinned "
                           "copy to prefetch from")
    running = _largest_streamed(spec, placed)
    raised = []
    for stage in stages:
        use = stage.use.get(execution)
        if spec.name not in stage.components or use is None:
            continue
        reserve = max(use.reserve, running + prefetch)
        capacity = capacities.get(execution)
        if capacity is not None and use.peak - use.reserve + reserve > capacity:
            short = use.peak - use.reserve + reserve - capacity
            return synchronous(f"the prefetched block ({format_size(prefetch)}) does not fit beside the running one "
                               f"on GPU {execution} in the {stage.name} stage ({format_size(short)} short)")
        raised.append((use, reserve))
    for use, reserve in raised:
        use.reserve = reserve
    disk = f"; its {format_size(placed.disk_bytes)} on disk stay synchronous" if placed.disk_bytes else ""
    return {"mode": OVERLAPPED, "prefetch_bytes": prefetch, "pinned_bytes": pinned,
            "reason": f"each block's copy from pinned RAM ({format_size(pinned)}) runs on a second stream while the "
                      f"block before it computes; the prefetched block ({format_size(prefetch)}) fits beside the "
                      f"running one on GPU {execution}{disk}"}


def _largest_streamed(spec, placed) -> int:
    """The largest block streamed to the execution device (cpu or disk): the room the running block takes."""
    return max((b.bytes for b in spec.blocks
                if str(placed.device_map.get(b.name, placed.device_map.get(""))) in ("cpu", "disk")), default=0)


def room_wanted(plan, specs) -> dict[str, int]:
    """Execution GPU -> bytes a placement must leave free there for the synchronous components' prefetched blocks
    that did not fit: a placement that keeps that much free (offloading a block or so more) can overlap them."""
    wanted: dict[str, int] = {}
    for spec in specs:
        placed = plan.components.get(spec.name)
        if placed is None or placed.offload.get("mode") != SYNCHRONOUS or "does not fit" not in placed.offload["reason"]:
            continue
        prefetch = max((b.bytes for b in spec.blocks
                        if str(placed.device_map.get(b.name, placed.device_map.get(""))) == "cpu"), default=0)
        key = str(placed.execution_device)
        wanted[key] = max(wanted.get(key, 0), prefetch)
    return wanted


def faster_line(names: list[str], synchronous_s: float, overlapped_s: float, more_bytes: int) -> str:
    """The plan's line for a placement chosen to leave room for the prefetched blocks."""
    return (f"{', '.join(names)}: {format_size(more_bytes)} more offloaded to leave room for the prefetched block, so "
            f"that its copies overlap compute: predicted step {overlapped_s:.3g} s, against {synchronous_s:.3g} s with "
            f"the fuller GPU copying each block in its turn.")
