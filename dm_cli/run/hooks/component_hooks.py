"""The hooks every run mode's loop puts on the components it loads (dm_cli.run.hooks.hooks' registry), in this order:
tiled decode, the LoRAs, the step cache, the meter, the split check. A run mode with its own version registers it
under the same name (dm_cli.run.ranks.parallel's step cache, dm_cli.run.ranks.pipeline's slice cache and slice ends)."""

from __future__ import annotations

from dm_cli.run.hooks.adapters import ADAPTER_PREFIX, load_loras
from dm_cli.run.hooks.hooks import LoopHook, LoopHooks
from dm_cli.run.hooks.step_cache import StepCounts, apply


def fused_loras(plan) -> frozenset:
    """The components whose LoRAs the plan merges into their weights at load (a plan file without `fused`: none)."""
    return frozenset(entry["component"] for entry in getattr(plan, "loras", None) or [] if entry.get("fused"))


def standard_hooks(loop) -> LoopHooks:
    """The registry of a loop: what one process does to each component as it loads."""
    hooks = LoopHooks()
    hooks.register_hook(TiledDecode(loop.plan), "tiling")
    hooks.register_hook(Loras(loop), "lora")
    hooks.register_hook(StepCache(loop), "step_cache")
    hooks.register_hook(Meter(loop), "meter")
    if loop.simulate:
        hooks.register_hook(SplitCheck(loop), "split_check")
    return hooks


class TiledDecode(LoopHook):
    """The VAE decodes in tiles where the plan says it must (checked: the class tiles, check_tiled_decode)."""

    def __init__(self, plan):
        self.plan = plan

    def apply(self, name: str, model) -> None:
        if name in self.plan.tiled_decode:
            model.enable_tiling()


class Loras(LoopHook):
    """The run's LoRA adapters (settled), loaded into their component each time it loads, before the meter counts
    the weights (the adapters sit beside the layers they patch); unfused ones switched to each job's choice."""

    def __init__(self, loop):
        self.loop = loop
        self.loras = tuple(loop.loras)
        self.fused = fused_loras(loop.plan)  # components whose LoRAs the plan fuses into the weights at load
        # unfused components with adapters -> the LoRAs active in them now (set_adapters), and those the running job
        # chose (None: the run's own), applied to each such component as it loads and before each denoise
        self.active: dict[str, tuple] = {}
        self.job_loras: tuple | None = None

    def apply(self, name: str, model) -> None:
        patching = [lora for lora in self.loras if lora.component == name]
        if not patching:
            return

        loop = self.loop
        loop.status(f"Loading {len(patching)} LoRA(s) into {name}…")
        load_loras(loop.pipe, name, model, patching, loop.torch_dtype, fuse=name in self.fused)
        if name not in self.fused:
            self.active[name] = tuple(patching)
            self.switch(name, model)

    def remove(self, name: str) -> None:
        self.active.pop(name, None)

    def reset(self, job=None) -> None:
        if job is not None:
            self.use(job.loras)

    def use(self, loras: tuple) -> None:
        """The adapters a job runs with (settled, in order: `Job.loras`), made the active ones of every loaded
        component that holds them unfused, and of each such component loaded later (Wan 2.2's second expert)."""
        self.job_loras = tuple(loras)
        for name in list(self.active):
            self.switch(name, self.loop.loaded[name])

    def switch(self, name: str, model) -> None:
        """peft's `set_adapters` on component `name` for the running job's adapters, only where they differ from the
        active ones: the adapters dmap loaded from the same files, at the job's scales, in the job's order (each
        adapter's term is added in that order, as `dmap run --lora` with that set adds them); none: the base layers
        alone. An unchosen adapter is inactive, never computed."""
        if self.job_loras is None:
            return
        wanted = tuple(lora for lora in self.job_loras if lora.component == name)
        if wanted == self.active[name]:
            return

        patching = [lora for lora in self.loras if lora.component == name]
        index = {(lora.path, lora.digest): n for n, lora in enumerate(patching)}
        model.set_adapters([f"{ADAPTER_PREFIX}{index[lora.path, lora.digest]}" for lora in wanted],
                           [lora.scale for lora in wanted])
        self.active[name] = wanted


class StepCache(LoopHook):
    """--cache: diffusers' hooks on each cached denoiser while it is loaded (dm_cli.run.hooks.step_cache), their counts over
    every denoise of the loop; each hook state emptied before and after each denoise."""

    def __init__(self, loop):
        self.plan, self.family = loop.plan, loop.family
        self.counters: dict[str, object] = {}  # component -> its StepCounter while loaded
        self.counts: dict[str, object] = {}  # component -> StepCounts over every denoise of this loop

    def cached(self, name: str) -> bool:
        return self.plan.cache is not None and name in self.plan.step_cache.get("components", {})

    def apply(self, name: str, model) -> None:
        self.enable(name, model, None)

    def enable(self, name: str, model, steps: int | None) -> None:
        """The plan's step cache on a cached denoiser (diffusers' enable_cache; magcache for `steps`)."""
        if not self.cached(name):
            return

        counter = apply(model, self.plan.cache, self.family, steps, self.plan.dtype)
        counter.counts = self.counts.setdefault(name, StepCounts())
        counter.steps = steps
        self.counters[name] = counter

    def remove(self, name: str) -> None:
        counter = self.counters.pop(name, None)
        if counter is not None:
            counter.remove()

    def reset(self, job=None) -> None:
        """Each cached denoiser's hook state emptied (the next image starts from nothing; the memory goes back);
        before a denoise, magcache's config remade for the job's steps where it was made for others."""
        steps = job.steps if job is not None else None
        for name, counter in list(self.counters.items()):
            if steps is not None and self.plan.cache.name == "magcache" and counter.steps != steps:
                counter.remove()
                counter.model.disable_cache()
                self.enable(name, counter.model, steps)
            else:
                counter.reset()


class Meter(LoopHook):
    """The meter and what each stage measured: weights registered and activations charged to the device of the
    module that makes them (dm_cli.run.load.meter) while a component is loaded; the peaks of each stage."""

    def __init__(self, loop):
        self.loop = loop
        self.meter = loop.meter
        self.handles: dict[str, list] = {}

    def apply(self, name: str, model) -> None:
        cmap = self.loop.device_map(name)
        default_dev = str(next(iter(cmap.values())))
        self.meter.register_weights(model, cmap, default_dev)
        self.handles[name] = self.meter.attach(model, cmap, default_dev)

    def remove(self, name: str) -> None:
        for handle in self.handles.pop(name, []):
            handle.remove()

    def mode(self, names: list[str]) -> tuple[bool, bool]:
        """(track activations op by op, sample the process's peak RSS) for a stage running `names`:
        only where something runs on the CPU (CUDA counts its own peaks), and never when not measuring."""
        loop = self.loop
        on_cpu = loop.measure and (not loop.cuda or any(loop._device([c]).type == "cpu" for c in names))
        track = on_cpu and loop.track_activations
        return track, on_cpu and not track

    def reset_peaks(self) -> None:
        import torch  # lazy: torch (heavy, off start-up)

        self.meter.reset_peaks()
        if self.loop.cuda:
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)

    def measured(self, stage, rss=None) -> None:
        """Peak per device since the last reset: weights resident after the load + tracked activations
        (without the tracker, `rss`: what the process's resident set grew by, charged to the cpu)."""
        import torch  # lazy: torch (heavy, off start-up)

        resident = stage.resident_after_load
        grown = dict(self.meter.peak)
        if rss is not None:  # what the run added on top of the loaded weights, charged to the cpu
            grown["cpu"] = max(0, rss.peak - rss.start)
        stage.measured_peak = {d: resident.get(d, 0) + grown.get(d, 0)
                               for d in set(resident) | set(grown) if d != "disk" and resident.get(d, 0) + grown.get(d, 0)}
        if self.loop.cuda:
            for i in range(torch.cuda.device_count()):
                stage.measured_peak[str(i)] = torch.cuda.max_memory_allocated(i)


class SplitCheck(LoopHook):
    """--simulate: the tracer's split check active during each forward of a component (not the pipeline's glue
    around it); what it finds collects in `problems`."""

    def __init__(self, loop):
        self.loop = loop
        self.ran = False  # whether the check could run (the tracer is part of this build)
        self.problems: list[str] = []
        self.handles: dict[str, list] = {}

    def apply(self, name: str, model) -> None:
        try:
            from dm_cli.planning.trace.trace import VirtualDevices  # lazy: a build without the tracer skips the check
        except ImportError:
            return
        checker = VirtualDevices(model, self.loop.device_map(name))
        self.ran = True
        problems = self.problems

        def pre(_module, _args):
            checker.__enter__()

        def post(_module, _args, _out):
            checker.__exit__(None, None, None)
            for problem in checker.problems:
                entry = f"{name}: {problem}"
                if entry not in problems:
                    problems.append(entry)

        self.handles[name] = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]

    def remove(self, name: str) -> None:
        for handle in self.handles.pop(name, []):
            handle.remove()
