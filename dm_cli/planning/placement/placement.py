"""The search's answer (search.py): each component's device map, each stage's use of each device, and NoFit
when nothing fits. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from dm_cli.families.stages import stage_kind


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
    stage: str  # the first stage that runs it
    disk_bytes: int = 0
    stages: tuple[str, ...] = ()  # every stage that runs it, when more than `stage` (a VAE that encodes and decodes)
    # how its streamed blocks reach the execution device (overlap.py): {"mode": "overlapped" | "synchronous",
    # "reason", "prefetch_bytes", "pinned_bytes"}; empty when it streams none
    offload: dict = field(default_factory=dict)

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
    cache: int = 0  # what a step cache's hooks hold there between steps (dm_cli.planning.step_cache)

    @property
    def peak(self) -> int:
        return self.weights + self.reserve + self.activations + self.overhead + self.cache


@dataclass
class StagePlacement:
    name: str
    components: list[str]
    use: dict[str, DeviceUse]  # device name -> breakdown (only devices used in this stage)
    note: str = ""  # how this stage's components are loaded, when that is not obvious (experts)
    consumes: tuple[str, ...] = ()  # the values the stage takes and makes (dm_cli.families.stages)
    produces: tuple[str, ...] = ()

    @property
    def peak_bytes(self) -> dict[str, int]:
        return {device: use.peak for device, use in self.use.items()}

    @property
    def kind(self) -> str | None:
        """What runs the stage (dm_cli.families.stages.stage_kind); None: nothing dmap run knows."""
        return stage_kind(self.produces)


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
