"""--compile: torch.compile on the denoiser as it loads, in one place (the `compile` loop hook every Session registers
last, after the LoRAs are fused, the step cache, the meter and the split check are on).

`regional` (`auto`): diffusers' `ModelMixin.compile_repeated_blocks(fullgraph=True)` where the model declares
`_repeated_blocks` (each repeated block compiled once and the graph reused by its twins), else the whole model;
`full`: the whole model (`nn.Module.compile`). What cannot compile is settled before anything loads
(`compile_choice`): ranks sharing a step are refused in one sentence; what dmap watches op by op (--simulate's split
check, --track-activations), LoRAs kept unfused, blocks streamed from cpu or disk through accelerate's hooks, GGUF and
NF4 weights and the step caches' data-dependent skips run eager, with one notice saying why. dynamo's recompile limit
is raised for the recompiles a split denoiser's devices and a queue's sizes cause. The cold compile's seconds are what
dynamo reports spending (`compile_seconds`), shown apart from the steps'.
"""

from __future__ import annotations

import os

from dm_cli.errors import UsageError
from dm_cli.planning.modes import CompileMode, parse_compile
from dm_cli.run.hooks.hooks import LoopHook

# dynamo's per-code-object recompile limit (8 by default): a block compiled per device it runs on, per shape a
# queue or a server meets
RECOMPILE_LIMIT = 64
# a test's and a bench's way to trace without inductor's C++ build (dynamo's "eager" backend); unset: inductor
BACKEND_ENV = "DMAP_COMPILE_BACKEND"


# weight formats whose layers run Python at each call that dynamo cannot trace in one graph (int8, torchao's tensor
# subclass, compiles)
PYTHON_WEIGHTS = {
    "fp8": "are cast up by diffusers' layerwise-casting hooks, which make a parameter at each call",
    "nf4": "are dequantized by bitsandbytes at each call",
    "gguf": "are dequantized in Python at each call",
}


def compile_choice(mode, request, plan, family, sharing) -> tuple[CompileMode, str | None]:
    """(what the run compiles, a notice saying why it runs eager instead), settled before anything loads; ranks
    sharing a step are refused (UsageError)."""
    mode = parse_compile(mode)
    if mode is CompileMode.NONE:
        return mode, None
    if sharing is not None:
        raise UsageError(f"--compile runs in one process: --parallel {sharing.layout} ranks hand tensors to each other "
                         "inside the denoiser's forward, which dmap does not compile yet; drop --compile or --parallel.")
    reason = eager_reason(request, plan, family)
    if reason is None:
        return mode, None
    return CompileMode.NONE, f"--compile {mode}: running eager, {reason}."


def denoisers(family) -> tuple[str, ...]:
    return (family.denoiser, *family.experts)


def eager_reason(request, plan, family) -> str | None:
    """Why this run's denoisers cannot compile (None: they can)."""
    from dm_cli.run.hooks.component_hooks import fused_loras  # lazy: the options table imports this module at start-up

    names = [name for name in denoisers(family) if name in plan.components]
    if request.simulate or request.track_activations:
        return ("the activation tracker of --simulate and --track-activations counts every op as it runs (run without "
                "them to compile)")
    fused = fused_loras(plan)
    unfused = sorted({lora.component for lora in getattr(request.generation, "loras", None) or ()
                      if lora.component in names and lora.component not in fused})
    if unfused:
        return (f"the LoRAs of {', '.join(unfused)} stay unfused (each job switches them), which would recompile; "
                "a plan that fuses them compiles")
    weights = {name: plan.weights.get(name) for name in names if plan.weights.get(name) in PYTHON_WEIGHTS}
    if weights:
        name, fmt = next(iter(weights.items()))
        return f"{name}'s {fmt} weights {PYTHON_WEIGHTS[fmt]}"
    files = [str(getattr(request, "source", None) or ""), *(getattr(request, "component_files", None) or {}).values()]
    if any(str(path).lower().endswith(".gguf") for path in files):
        return f"GGUF weights {PYTHON_WEIGHTS['gguf']}"
    offloaded = [name for name in names if _offloaded(plan.components[name].device_map)]
    if offloaded:
        return (f"{', '.join(offloaded)} streams blocks from cpu or disk through accelerate's hooks, which move weights "
                "in Python at each call")
    if plan.cache is not None:
        return f"the step cache {plan.cache.name} decides in Python at each call which blocks run"
    return None


def _offloaded(device_map: dict) -> bool:
    """Whether some blocks are stored off the device they compute on (disk, or cpu beside GPUs)."""
    where = {str(device) for device in device_map.values()}
    return "disk" in where or ("cpu" in where and len(where) > 1)


def compile_model(model, mode: CompileMode) -> str:
    """Compile `model` in place as `mode` asks; returns what was done ("regional" or "full")."""
    import torch  # lazy: torch (heavy, off start-up)

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed in torch 2.6; both where both exist
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT * 4)
    options = {"fullgraph": True}
    backend = os.environ.get(BACKEND_ENV)
    if backend:
        options["backend"] = backend
    if mode is not CompileMode.FULL and getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(**options)
        return "regional"
    model.compile(**options)
    return "full"


def compile_seconds() -> float:
    """Seconds dynamo (with its backend) has spent compiling in this process so far."""
    try:
        from torch._dynamo.utils import compilation_time_metrics  # lazy: torch (heavy, off start-up)
    except ImportError:
        return 0.0
    return float(sum(sum(times) for key, times in compilation_time_metrics.items() if key == "_compile.compile_inner"))


class CompileHook(LoopHook):
    """The `compile` loop hook: each denoiser compiled as it loads (after every other hook is on it)."""

    def __init__(self, mode: CompileMode, family):
        self.mode = mode
        self.names = denoisers(family)
        self.compiled: dict[str, str] = {}  # component -> "regional" | "full"

    def apply(self, name: str, model) -> None:
        if name in self.names:
            self.compiled[name] = compile_model(model, self.mode)

    def remove(self, name: str) -> None:
        self.compiled.pop(name, None)

    def seconds(self) -> float:
        """dynamo's compile seconds in this process so far (a stage's are the difference across it)."""
        return compile_seconds()
