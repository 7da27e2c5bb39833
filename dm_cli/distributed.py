"""Spreading a queue over processes launched by torchrun: ranks, GPU groups, coordination.

dmap has no scheduler of its own. `torchrun` (one node or many: `--nnodes/--node-rank/
--rdzv-endpoint`) starts the processes and sets WORLD_SIZE, RANK, LOCAL_RANK and
LOCAL_WORLD_SIZE; each process then:

1. picks its group of GPUs before CUDA initialises (`select_gpus`: local rank r with K GPUs per
   rank sees GPUs r*K .. r*K+K-1 of the node, renumbered 0..K-1, through CUDA_VISIBLE_DEVICES);
2. joins a gloo process group (`Ranks.join`), which only carries small Python objects: no
   tensors, no NCCL, so CPU-only launches work the same way;
3. generates its share of the queue (`queue.items_for_rank`);
4. sends its manifest records to rank 0 (`Ranks.gather`), which writes the merged manifest.

torch.distributed is used directly: accelerate's PartialState would come up as a single process
under a CPU-only torchrun unless given cpu=True, and dmap needs nothing else from it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

from .errors import UsageError

# Ranks finish their shares at different times and wait for each other only at the end; if a rank
# dies, torchrun stops the others, so a long wait never hangs a job. Override in seconds.
DEFAULT_TIMEOUT_S = 7 * 24 * 3600


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in a torchrun launch (world_size 1: a plain run)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Ranks":
        """Read torchrun's variables; their absence means a single process."""
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env:
            return cls()
        def read(key: str, default: int | None = None) -> int:
            text = env.get(key)
            if text is None:
                if default is None:
                    raise UsageError(f"WORLD_SIZE is set but {key} is not: launch dmap with torchrun, which sets both.")
                return default
            try:
                return int(text)
            except ValueError:
                raise UsageError(f"{key}={text!r} is not an integer: launch dmap with torchrun.") from None

        world_size = read("WORLD_SIZE")
        values = {"RANK": read("RANK"), "WORLD_SIZE": world_size, "LOCAL_RANK": read("LOCAL_RANK", 0),
                  "LOCAL_WORLD_SIZE": read("LOCAL_WORLD_SIZE", world_size)}
        ranks = cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"])
        if ranks.world_size < 1 or not 0 <= ranks.rank < ranks.world_size \
                or not 0 <= ranks.local_rank < max(1, ranks.local_world_size):
            raise UsageError(f"Inconsistent torchrun variables (RANK={ranks.rank}, WORLD_SIZE={ranks.world_size}, "
                             f"LOCAL_RANK={ranks.local_rank}): launch dmap with torchrun.")
        return ranks

    def join(self) -> None:
        """Join the gloo group torchrun's rendezvous set up (MASTER_ADDR/MASTER_PORT); no-op alone."""
        if not self.distributed:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            return
        timeout = int(os.environ.get("DMAP_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
        dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=timeout))

    def gather(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (in rank order), None elsewhere; `[obj]` alone."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def leave(self) -> None:
        if not self.distributed:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def select_gpus(ranks: Ranks, gpus_per_rank: int | None, env: dict | None = None) -> list[str] | None:
    """Give local rank r the GPUs r*K .. r*K+K-1 of its node, via CUDA_VISIBLE_DEVICES; returns them.

    Must run before CUDA initialises (it is read once, at initialisation). The GPUs counted are
    the ones already visible (an existing CUDA_VISIBLE_DEVICES is narrowed, not replaced). K=None:
    nothing changes (a single process sees every GPU; under torchrun pass --gpus-per-rank).
    K=0: this rank sees no GPU (CPU ranks).
    """
    env = os.environ if env is None else env
    if gpus_per_rank is None:
        return None
    if gpus_per_rank < 0:
        raise UsageError("--gpus-per-rank must be 0 or more.")
    if _cuda_initialised():
        raise UsageError("CUDA was initialised before the GPU group was chosen: --gpus-per-rank cannot apply.")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        pool = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        pool = [str(i) for i in range(_count_gpus())]
    first = ranks.local_rank * gpus_per_rank
    group = pool[first:first + gpus_per_rank]
    if len(group) < gpus_per_rank:
        raise UsageError(
            f"Local rank {ranks.local_rank} needs GPUs {first}..{first + gpus_per_rank - 1} (--gpus-per-rank "
            f"{gpus_per_rank}) but this node has {len(pool)} visible: lower --nproc-per-node or --gpus-per-rank."
        )
    env["CUDA_VISIBLE_DEVICES"] = ",".join(group)
    return group


def _count_gpus() -> int:
    """GPUs on this node without initialising CUDA in this process (NVML via nvidia-smi's library)."""
    try:
        import ctypes

        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return 0
        count = ctypes.c_uint()
        status = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
        nvml.nvmlShutdown()
        return count.value if status == 0 else 0
    except OSError:
        return 0
