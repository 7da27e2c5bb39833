"""The hooks a stage loop puts on each component it loads, registered by name in one registry, in the style of
diffusers' `HookRegistry` (diffusers/hooks/hooks.py: `register_hook(hook, name)`, `get_hook`, `remove_hook`,
`reset_stateful_hooks`).

diffusers' registry wraps one module's forward; this one holds what a loop does to every component as it loads,
unloads and denoises: the meter, the split check, the LoRAs, the step cache, a pipeline rank's slice ends
(dm_cli.run.hooks.component_hooks, dm_cli.run.ranks.pipeline). Each run mode's loop registers its own under a name, in the
order they apply; the loop itself keeps no per-hook state. Plain Python: no torch here.
"""

from __future__ import annotations


class LoopHook:
    """One named thing a loop does to its components. `apply` as component `name` loads (after its weights, in
    the registry's order), `remove` as it unloads (in the reverse order), `reset` before each denoise (with the job)
    and after it (None)."""

    def apply(self, name: str, model) -> None:
        pass

    def remove(self, name: str) -> None:
        pass

    def reset(self, job=None) -> None:
        pass


class LoopHooks:
    """The registry: hooks by name, in the order they apply, and which of them each loaded component carries."""

    def __init__(self):
        self.hooks: dict[str, LoopHook] = {}  # in order
        self.applied: dict[str, list[str]] = {}  # component -> the hooks applied to it, in order

    def register_hook(self, hook: LoopHook, name: str, *, after: str | None = None) -> None:
        """Add `hook` as `name`, last or right after the hook named `after`; a name already taken is refused."""
        if name in self.hooks:
            raise ValueError(f"A loop hook named {name} is already registered: remove it first, or replace it.")
        if after is not None and after not in self.hooks:
            raise ValueError(f"No loop hook named {after} to register {name} after.")
        order = list(self.hooks.items())
        at = len(order) if after is None else [n for n, _ in order].index(after) + 1
        order.insert(at, (name, hook))
        self.hooks = dict(order)

    def replace_hook(self, name: str, hook: LoopHook) -> None:
        """`hook` in the place of the one named `name` (a run mode's own version of a hook, at the same point)."""
        if name not in self.hooks:
            raise ValueError(f"No loop hook named {name} to replace.")
        if any(name in names for names in self.applied.values()):
            raise ValueError(f"The loop hook {name} is on loaded components: unload them before replacing it.")
        self.hooks[name] = hook

    def get_hook(self, name: str) -> LoopHook | None:
        return self.hooks.get(name)

    def __getitem__(self, name: str) -> LoopHook:
        return self.hooks[name]

    def remove_hook(self, name: str) -> LoopHook | None:
        """Take the hook named `name` off every component that carries it, and out of the registry."""
        hook = self.hooks.pop(name, None)
        if hook is not None:
            for component, names in self.applied.items():
                if name in names:
                    names.remove(name)
                    hook.remove(component)
        return hook

    def apply(self, name: str, model, only: tuple[str, ...] | None = None) -> None:
        """Every hook (or those named in `only`) on component `name` as it loads, in the registry's order."""
        done = self.applied[name] = []
        for hook_name, hook in list(self.hooks.items()):
            if only is None or hook_name in only:
                hook.apply(name, model)
                done.append(hook_name)

    def remove(self, name: str) -> None:
        """Every hook component `name` carries taken off, in the reverse order."""
        for hook_name in reversed(self.applied.pop(name, [])):
            self.hooks[hook_name].remove(name)

    def reset(self, job=None) -> None:
        """Every hook's per-denoise state: before a denoise (`job`: the one about to run), after it (None)."""
        for hook in list(self.hooks.values()):
            hook.reset(job)
