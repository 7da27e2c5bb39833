"""`--cache` at run time: diffusers' cache hooks on the loaded denoiser, as the plan records them (`Plan.step_cache`).

`apply` calls the model's own `enable_cache` with the config `dm_cli.planning.step_cache.diffusers_config` builds
(the same one the plan counted on the meta device); `StepCounter` counts, without touching the hooks, how many of
the denoiser's calls ran its blocks in full: a probe on a module the hooks skip (inside the last block for fbc and
magcache, inside the first hooked attention for taylorseer) fires only when the work is done. The hooks' state is
reset before and after each denoise, so nothing of one image leaks into the next and the memory goes back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dm_cli.inputs import StepCache
from dm_cli.planning.step_cache import enable


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
    """The cache's hooks on `model` (diffusers' `enable_cache`, as the plan counted them: planning's `enable`), and
    a counter of the calls they skip."""
    enable(model, cache, family, steps, dtype)
    return StepCounter(model, cache)


class StepCounter:
    """Counts the denoiser's calls and those that ran the probed module (see the module's docstring); `probe`
    False: the computed calls are counted by whoever decides them (a pipeline slice's `SliceRelay`)."""

    def __init__(self, model, cache: StepCache, probe: bool = True):
        self.model = model
        self.counts = StepCounts()
        probe = _probe(model, cache) if probe else None
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
    import torch  # lazy: torch (heavy, off start-up)
    import torch.distributed as dist  # lazy: torch (heavy, off start-up)

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


# --- --parallel pipeline: fbc's and magcache's state across the slices ---------------------------------------------

class SliceRelay:
    """fbc and magcache on one rank of `--parallel pipeline` (dm_cli.run.ranks.pipeline): the first block is on rank 0 and
    the last on rank N - 1, and one process's hooks share a state between them. Here the decision is made on rank 0,
    which holds the first block (fbc: its residual against the last computed one's; magcache: the magnitude ratios
    of the step), and travels with the activations, so every rank skips the same calls: each message between
    slices carries, after the block's inputs, the first block's tensors the last block needs (fbc: its output,
    magcache: its input; on computed calls only) and a header (computed or not, how many tensors, a list or not).
    Every state is the current cache context's (one per prompt in flight and guidance branch).

    A skipped call in one process adds the last block's residuals at the first block, and the blocks between pass
    it on unchanged; here the first block passes its own output (fbc) or input (magcache) on, and the last block,
    which holds the residuals, adds them, the same operation on the same tensors: the same bytes."""

    def __init__(self, model, cache: StepCache, rank: int, world_size: int):
        self.cache = cache
        self.first, self.last = rank == 0, rank == world_size - 1
        self.counter = None  # the StepCounter whose `computed` this rank's decisions count
        self.manager = None
        self.hooks = []
        for module in model.modules():
            registry = getattr(module, "_diffusers_hook", None)
            for hook in (registry.hooks.values() if registry is not None else ()):
                manager = getattr(hook, "state_manager", None)
                if manager is None:
                    continue
                self.manager = manager
                self.hooks.append(hook)
                # the registry calls `fn_ref.forward`: the hook's new_forward bound to its module when registered
                if self.first and "Head" in type(hook).__name__:
                    hook.fn_ref.forward = functools.partial(_first_block(hook, cache.name), module)
                elif self.last and getattr(hook, "is_tail", False):
                    hook.fn_ref.forward = functools.partial(_last_block(hook, hook.fn_ref.forward, cache.name), module)
        self.held = TRAVELS[cache.name]

    def use_config(self, config) -> None:
        """magcache: the config of the prompt about to compute (its number of steps; prompts in flight differ)."""
        for hook in self.hooks:
            if hasattr(hook, "config"):
                hook.config = config

    def outgoing(self, tensors: list) -> list:
        """The block inputs sent to the next rank, then this call's decision and the tensors that travel with it."""
        import torch  # lazy: torch (heavy, off start-up)

        state = self.manager.get_state()
        travelling = getattr(state, self.held)
        listed = isinstance(travelling, (list, tuple))
        extra = list(travelling) if listed else [travelling] if travelling is not None else []
        if not state.should_compute:
            extra = []
        setattr(state, self.held, None)  # the last rank keeps it; it went on from here
        self._count(state)
        header = torch.tensor([int(state.should_compute), len(extra), int(listed)], dtype=torch.int64,
                              device=tensors[0].device if tensors else None)  # NCCL sends what is on the GPU
        return [*tensors, *extra, header]

    def incoming(self, got: list) -> list:
        """The block inputs the previous rank sent; the decision and the travelling tensors into this call's state."""
        computed, count, listed = (int(v) for v in got[-1].tolist())
        extra, got = got[len(got) - 1 - count:-1], got[:len(got) - 1 - count]
        state = self.manager.get_state()
        state.should_compute = bool(computed)
        if computed:
            setattr(state, self.held, list(extra) if listed else extra[0])
        if self.last:
            self._count(state)
        return got

    def _count(self, state) -> None:
        if self.counter is not None and state.should_compute:
            self.counter.counts.computed += 1


TRAVELS = {"fbc": "head_block_output", "magcache": "head_block_input"}


def _first_block(hook, name: str):
    """Rank 0's first block under --parallel pipeline: diffusers' head hook, decision and state as they are, except
    that a skipped call passes the block's output (fbc) or input (magcache) on without the last block's residuals,
    which the last rank holds and adds (`_last_block`)."""
    meta = hook._metadata

    def fbc(module, *args, **kwargs):
        original = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        output = hook.fn_ref.original_forward(*args, **kwargs)
        hidden = output[meta.return_hidden_states_index] if isinstance(output, tuple) else output
        residual = hidden - original
        state = hook.state_manager.get_state()
        state.should_compute = hook._should_compute_remaining_blocks(residual)
        if state.should_compute:
            state.head_block_output = ([hidden, output[meta.return_encoder_hidden_states_index]]
                                       if isinstance(output, tuple) else output)
            state.head_block_residual = residual
        return output

    def magcache(module, *args, **kwargs):
        from diffusers.hooks.hooks import CacheContext  # lazy: diffusers (heavy, off start-up)

        if hook.state_manager._context is None:
            hook.state_manager.set_context(CacheContext(name="inference"))
        config = hook.config
        hidden = meta._get_parameter_from_args_kwargs(meta.hidden_states_argument_name, args, kwargs)
        state = hook.state_manager.get_state()
        state.head_block_input = hidden
        should_compute = True
        if not config.calibrate:  # diffusers' MagCacheHeadHook's decision, as it stands
            step = state.step_index
            scale = config.mag_ratios[step] if step < len(config.mag_ratios) else 1.0
            if step >= int(config.retention_ratio * config.num_inference_steps + 0.5):
                state.accumulated_ratio *= scale
                state.accumulated_steps += 1
                state.accumulated_err += abs(1.0 - state.accumulated_ratio)
                if (state.previous_residual is not None and state.accumulated_err <= config.threshold
                        and state.accumulated_steps <= config.max_skip_steps):
                    should_compute = False
                else:
                    state.accumulated_ratio, state.accumulated_steps, state.accumulated_err = 1.0, 0, 0.0
        state.should_compute = should_compute
        # what the last block does to the state, mirrored: a computed call leaves a residual (on the last rank, so a
        # stand-in here), and every call advances the step (diffusers' MagCacheBlockHook._advance_step)
        if should_compute:
            state.previous_residual = True
        _advance_magcache_step(state, config)
        if should_compute:
            return hook.fn_ref.original_forward(*args, **kwargs)
        if meta.return_encoder_hidden_states_index is None:
            return hidden
        out = [None] * (max(meta.return_hidden_states_index, meta.return_encoder_hidden_states_index) + 1)
        out[meta.return_hidden_states_index] = hidden
        out[meta.return_encoder_hidden_states_index] = meta._get_parameter_from_args_kwargs(
            "encoder_hidden_states", args, kwargs)
        return tuple(out)

    return fbc if name == "fbc" else magcache


def _advance_magcache_step(state, config) -> None:
    state.step_index += 1
    if state.step_index >= config.num_inference_steps:
        state.step_index, state.accumulated_ratio, state.accumulated_steps, state.accumulated_err = 0, 1.0, 0, 0.0
        state.previous_residual = None


def _last_block(hook, forward, name: str):
    """The last rank's last block: diffusers' tail hook, and on a skipped call the residuals it holds added to the
    inputs that came through, as one process's first block adds them to its output (fbc: both streams; magcache:
    the hidden states)."""
    meta = hook._metadata

    def new_forward(module, *args, **kwargs):
        state = hook.state_manager.get_state()
        if state.should_compute:
            return forward(*args, **kwargs)
        residuals = state.tail_block_residuals if name == "fbc" else state.previous_residual
        output = forward(*args, **kwargs)  # the inputs, passed on (magcache: the step advanced)
        listed = isinstance(output, tuple)
        parts = list(output) if listed else [output]
        index = meta.return_hidden_states_index if listed else 0
        if name == "fbc":
            parts[index] = residuals[0] + parts[index]
            if meta.return_encoder_hidden_states_index is not None:
                encoder = meta.return_encoder_hidden_states_index
                parts[encoder] = residuals[1] + parts[encoder]
        else:
            parts[index] = _add_magcache_residual(parts[index], residuals)
        return tuple(parts) if listed else parts[0]

    return new_forward


def _add_magcache_residual(hidden, residual):
    """diffusers' MagCacheHeadHook on a skipped step: the residual added to the hidden states (to their image tokens,
    at the end, where the last block returned a longer sequence)."""
    residual = residual.to(hidden.device)
    if residual.shape == hidden.shape:
        return hidden + residual
    if hidden.ndim == 3 and residual.ndim == 3 and hidden.shape[0] == residual.shape[0] \
            and hidden.shape[2] == residual.shape[2] and hidden.shape[1] > residual.shape[1]:
        diff = hidden.shape[1] - residual.shape[1]
        hidden = hidden.clone()
        hidden[:, diff:, :] = hidden[:, diff:, :] + residual
    return hidden


def lite_block_hook(model):
    """A TaylorSeer hook of one of the model's blocks in lite mode (every block inactive: zeros on a predicted call,
    `proj_out` alone predicting, so a predicted call's output depends on nothing the blocks are given), else None."""
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook  # lazy: diffusers (heavy, off start-up)

    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in (registry.hooks.values() if registry is not None else ()):
            if isinstance(hook, TaylorSeerCacheHook) and hook.state_manager._init_kwargs.get("is_inactive"):
                return hook
    return None


def predicts_next_call(hook) -> bool:
    """Whether the next call of the module `hook` (a TaylorSeerCacheHook) is predicted rather than computed, in the
    current cache context: diffusers' own rule (`TaylorSeerCacheHook._measure_should_compute`) read one step ahead,
    without counting the call."""
    step = hook.state_manager.get_state().current_step + 1
    before, after = hook.disable_cache_before_step, hook.disable_cache_after_step
    computed = step < before or (step - before - 1) % hook.cache_interval == 0 or (after is not None and step >= after)
    return not computed


def drop_states(model, prefix: str) -> None:
    """The hook states of the cache contexts named `prefix...` emptied and dropped (one prompt in flight's, under
    --parallel pipeline: the others' stay)."""
    managers = {}
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in (registry.hooks.values() if registry is not None else ()):
            manager = getattr(hook, "state_manager", None)
            if manager is not None:
                managers[id(manager)] = manager
    for manager in managers.values():
        for name in [n for n in manager._state_cache if n.startswith(prefix)]:
            manager._state_cache.pop(name).reset()
