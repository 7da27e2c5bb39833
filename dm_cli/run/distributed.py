"""Spreading a queue over processes launched by torchrun: ranks, GPU groups, coordination.

dmap has no scheduler of its own. `torchrun` (one node or many: `--nnodes/--node-rank/
--rdzv-endpoint`) starts the processes and sets WORLD_SIZE, RANK, LOCAL_RANK and
LOCAL_WORLD_SIZE; each process then:

1. picks its group of GPUs before CUDA initialises (`select_gpus`: local rank r with K GPUs per
   rank sees GPUs r*K .. r*K+K-1 of the node, renumbered 0..K-1, through CUDA_VISIBLE_DEVICES);
2. joins a gloo process group (`Ranks.join`), which only carries small Python objects: no
   tensors, no NCCL, so CPU-only launches work the same way (`dmap run --parallel`, dm_cli.run.ranks.parallel,
   exchanges tensors every step: over gloo on CPUs, NCCL on GPUs);
3. generates its share of the queue (`queue.items_for_rank`);
4. sends its manifest records to rank 0 (`Ranks.gather`), which writes the merged manifest.

torch.distributed is used directly: accelerate's PartialState would come up as a single process
under a CPU-only torchrun unless given cpu=True, and dmap needs nothing else from it.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta

from dm_cli.errors import DmapError, UsageError

# Ranks finish their shares at different times and wait for each other only at the end; if a rank
# dies, torchrun stops the others, so a long wait never hangs a job. Override in seconds.
DEFAULT_TIMEOUT_S = 7 * 24 * 3600
MAX_TIMEOUT_S = 365 * 24 * 3600
MAX_RANKS = 2**31 - 1  # gloo counts ranks in a C int
LAUNCH = "launch dmap with torchrun, which sets it"
LAUNCH_BOTH = "launch dmap with torchrun, which sets both"


def _show(text: str) -> str:
    """A value read from the environment, quoted, escaped and short (it lands in an error sentence)."""
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def _integer(env, key: str, low: int, high: int, default: int | None = None) -> int:
    """A whole number from `low` to `high`, written in ASCII digits (torchrun's variables, ports)."""
    text = env.get(key)
    if text is None:
        if default is None:
            raise UsageError(f"WORLD_SIZE is set but {key} is not: {LAUNCH_BOTH}.")
        return default
    if not re.fullmatch(r"-?[0-9]{1,19}", text.strip()):
        raise UsageError(f"{key}={_show(text)} is not an integer: {LAUNCH}.")
    value = int(text)
    if not low <= value <= high:
        raise UsageError(f"{key}={value} is out of range (it must be from {low} to {high}): {LAUNCH}.")
    return value


def _timeout(env) -> int:
    """DMAP_DIST_TIMEOUT: how long ranks wait for each other, in whole seconds (1 s to 365 days)."""
    text = env.get("DMAP_DIST_TIMEOUT")
    if text is None:
        return DEFAULT_TIMEOUT_S
    value = int(text) if re.fullmatch(r"[0-9]{1,19}", text.strip()) else None
    if value is None or not 1 <= value <= MAX_TIMEOUT_S:
        raise UsageError(f"DMAP_DIST_TIMEOUT={_show(text)} is not a whole number of seconds from 1 to "
                         f"{MAX_TIMEOUT_S} (365 days): set it to one, or unset it for the default of 7 days.")
    return value


def _check_rendezvous(env) -> None:
    """MASTER_ADDR and MASTER_PORT, which gloo's env:// rendezvous reads: checked before anything loads."""
    address = env.get("MASTER_ADDR")
    if address is None:
        raise UsageError(f"WORLD_SIZE is set but MASTER_ADDR is not: {LAUNCH}, or set it to rank 0's host.")
    if not address or len(address) > 255 or not address.isprintable() or any(c.isspace() for c in address):
        raise UsageError(f"MASTER_ADDR={_show(address)} is not a host name or address: {LAUNCH}.")
    if env.get("MASTER_PORT") is None:
        raise UsageError(f"WORLD_SIZE is set but MASTER_PORT is not: {LAUNCH}, or set it to a free port of "
                         "rank 0's host.")
    port = env["MASTER_PORT"]
    if not re.fullmatch(r"[0-9]{1,5}", port.strip()) or not 1 <= int(port) <= 65535:
        raise UsageError(f"MASTER_PORT={_show(port)} is not a port number (1 to 65535): {LAUNCH}.")


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in a torchrun launch (world_size 1: a plain run)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    timeout_s: int = field(default=DEFAULT_TIMEOUT_S, compare=False)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Ranks":
        """Read torchrun's variables; their absence means a single process.

        Every variable a launch reads is checked here, before anything loads or joins: each bad one
        is a UsageError naming it (torch would fail later, with a traceback, or wait for a rank that
        cannot come).
        """
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env:
            return cls()
        world_size = _integer(env, "WORLD_SIZE", 1, MAX_RANKS)
        rank = _integer(env, "RANK", 0, MAX_RANKS)
        local_world_size = _integer(env, "LOCAL_WORLD_SIZE", 1, MAX_RANKS, default=world_size)
        local_rank = _integer(env, "LOCAL_RANK", 0, MAX_RANKS, default=0)
        for key, value, bound, bound_key in (("RANK", rank, world_size, "WORLD_SIZE"),
                                             ("LOCAL_RANK", local_rank, local_world_size, "LOCAL_WORLD_SIZE")):
            if value >= bound:
                raise UsageError(f"Inconsistent torchrun variables: {key}={value} must be less than "
                                 f"{bound_key}={bound}; {LAUNCH_BOTH}.")
        if local_world_size > world_size:
            raise UsageError(f"Inconsistent torchrun variables: LOCAL_WORLD_SIZE={local_world_size} is more than "
                             f"WORLD_SIZE={world_size}; {LAUNCH_BOTH}.")
        timeout = DEFAULT_TIMEOUT_S
        if world_size > 1:  # a single process joins no group: it needs no rendezvous
            _check_rendezvous(env)
            timeout = _timeout(env)
        return cls(rank, world_size, local_rank, local_world_size, timeout)

    def join(self, backend: str = "gloo") -> None:
        """Join the group torchrun's rendezvous set up (MASTER_ADDR/MASTER_PORT); no-op alone. `backend`: gloo for
        a queue's small objects and CPU tensors; "cpu:gloo,cuda:nccl" when ranks exchange tensors on GPUs
        (dm_cli.run.ranks.parallel)."""
        if not self.distributed:
            return
        import torch.distributed as dist  # lazy: torch (heavy, off start-up)

        if dist.is_initialized():
            return
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.timeout_s))

    def gather(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (in rank order), None elsewhere; `[obj]` alone."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist  # lazy: torch (heavy, off start-up)

        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def leave(self) -> None:
        if not self.distributed:
            return
        import torch.distributed as dist  # lazy: torch (heavy, off start-up)

        if dist.is_initialized():
            dist.destroy_process_group()


EXIT_TERMINATED = 143  # 128 + SIGTERM, as shells report it


class Terminated(DmapError):
    """SIGTERM (torchrun sends it to every other rank when one ends), raised in the main thread: a pipeline rank then
    stops its threads and leaves its process group in order, as for Ctrl-C, instead of dying mid-step."""

    exit_code = EXIT_TERMINATED

    def __init__(self):
        super().__init__("Stopped by SIGTERM: what was written is complete, and the same command resumes the rest.")


class TerminateRaises:
    """While in effect, SIGTERM raises `Terminated` in the main thread, once (a repeated SIGTERM is ignored: the rank
    is already stopping in order); the handler before is restored on exit. A no-op outside the main thread, where
    Python cannot handle signals. Entered again (the queue, then its pipeline's stage loop), the outermost exit
    restores the handler."""

    def __init__(self):
        self._previous = None
        self._installed = False
        self.raised = False

    def _raise(self, _signum, _frame):
        if self.raised:
            return
        self.raised = True
        raise Terminated()

    def __enter__(self) -> "TerminateRaises":
        current = signal.getsignal(signal.SIGTERM) if hasattr(signal, "SIGTERM") else None
        if (threading.current_thread() is threading.main_thread() and current is not None
                and not isinstance(getattr(current, "__self__", None), TerminateRaises)):
            self._previous = signal.signal(signal.SIGTERM, self._raise)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


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
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return 0
        count = ctypes.c_uint()
        status = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
        nvml.nvmlShutdown()
        return count.value if status == 0 else 0
    except OSError:
        return 0


def broadcast(value, sharing):
    """Rank 0's `value` on every rank (tensors through the CPU: they may sit on rank 0's GPUs); `sharing`: anything
    that says whether this is rank 0 (`is_main`)."""
    import torch  # lazy: torch (heavy, off start-up)
    import torch.distributed as dist  # lazy: torch (heavy, off start-up)

    box = [_to_cpu(value) if sharing.is_main else None]
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    return box[0]


def _to_cpu(value):
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if hasattr(value, "tensors") and isinstance(value.tensors, dict):  # families.Embeds
        return type(value)(_to_cpu(value.tensors))
    return value
