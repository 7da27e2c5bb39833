"""`--cache` at run time: diffusers' cache hooks on the loaded denoiser, as the plan records them (`Plan.step_cache`).

`apply` calls the model's own `enable_cache` with the config `dm_cli.planning.step_cache.diffusers_config` builds
(the same one the plan counted on the meta device); `StepCounter` counts, without touching the hooks, how many of
the denoiser's calls ran its blocks in full: a probe on a module the hooks skip (inside the last block for fbc and
magcache, inside the first hooked attention for taylorseer) fires only when the work is done. The hooks' state is
reset before and after each denoise, so nothing of one image leaks into the next and the memory goes back.
"""

from __future__ import annotations

from dataclasses import dataclass

from dm_cli.inputs import StepCache


@dataclass
class StepCounts:
    """Denoiser calls in one run (every guidance branch counted) and how many computed their blocks in full."""

    calls: int = 0
    computed: int = 0

    @property
    def skipped(self) -> int:
        return self.calls - self.computed

    def to_json(self) -> dict:
        return {"calls": self.calls, "computed": self.computed, "skipped": self.skipped}


def apply(model, cache: StepCache, family, steps: int | None, dtype: str | None) -> "StepCounter":
    """The cache's hooks on `model` (diffusers' `enable_cache`), and a counter of the calls they skip."""
    from dm_cli.planning.step_cache import diffusers_config

    model.enable_cache(diffusers_config(cache, family, steps, dtype))
    return StepCounter(model, cache)


class StepCounter:
    """Counts the denoiser's calls and those that ran the probed module (see the module's docstring)."""

    def __init__(self, model, cache: StepCache):
        self.model = model
        self.counts = StepCounts()
        probe = _probe(model, cache)
        self._handles = [model.register_forward_pre_hook(self._call)]
        if probe is not None:
            self._handles.append(probe.register_forward_pre_hook(self._computed))
        self._in_call = False

    def _call(self, _module, _args):
        self.counts.calls += 1

    def _computed(self, _module, _args):
        self.counts.computed += 1

    def reset(self, steps: int | None = None) -> None:
        """Hook state back to empty (a new image starts from nothing) and, with `steps`, magcache's steps set."""
        self.model._reset_stateful_cache()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _probe(model, cache: StepCache):
    """The first submodule with parameters inside the module whose work the cache skips: the last block (fbc,
    magcache: skipped blocks return their input), or the first hooked attention (taylorseer: predicted outputs)."""
    hooked = [(name, module) for name, module in model.named_modules()
              if name and getattr(module, "_diffusers_hook", None) is not None and _cache_hooks(module._diffusers_hook)]
    if not hooked:
        return None
    if cache.name == "taylorseer":
        name, module = hooked[0]
        if cache.setting("lite"):  # lite: whole blocks are skipped, proj_out predicted
            name, module = next(((n, m) for n, m in hooked if n != "proj_out"), hooked[0])
    else:
        name, module = hooked[-1]
    inner = next((m for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))), None)
    return inner if inner is not None else module


def _cache_hooks(registry) -> list[str]:
    """The names of a module's hooks other than context parallel's ("cp_input---...", "cp_output---..."): under
    --parallel context the model's output layer carries those, and it runs whether the cache skips or not."""
    return [name for name in registry.hooks if not name.startswith("cp_")]


def agree_across(model, group) -> int:
    """fbc on ranks that each hold part of what one process's call holds (context parallel's sequence shards, a
    batched CFG's halves): the first block's residual change is reduced over `group` before it is compared with the
    threshold, so every rank skips the same steps as one process computing the whole call (a rank skipping alone would
    leave the others waiting in their all-to-all). Sums, not means: the shards are the same size, so
    sum|r - prev| / sum|prev| is the whole call's mean ratio. Returns how many of `model`'s hooks now agree."""
    import torch
    import torch.distributed as dist

    def decide(hook, residual) -> bool:
        state = hook.state_manager.get_state()
        previous = state.head_block_residual
        if previous is None:
            return True
        sums = torch.stack([(residual - previous).abs().sum(), previous.abs().sum()]).float()
        dist.all_reduce(sums, group=group)
        return (sums[0] / sums[1]).item() > hook.threshold

    hooks = 0
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook("fbc_leader_block_hook") if registry is not None else None
        if hook is not None:
            hook._should_compute_remaining_blocks = (lambda residual, _hook=hook: decide(_hook, residual))
            hooks += 1
    return hooks
