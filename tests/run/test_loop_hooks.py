"""The stage loop's hook registry (dm_cli.run.hooks.hooks): hooks applied to a component by name and in order, taken off
in the reverse order, reset around each denoise, replaced in place by a run mode's own version."""

from types import SimpleNamespace

import pytest

from dm_cli.run.hooks.hooks import LoopHook, LoopHooks


class Recording(LoopHook):
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def apply(self, name, model):
        self.log.append(("apply", self.name, name, model))

    def remove(self, name):
        self.log.append(("remove", self.name, name))

    def reset(self, job=None):
        self.log.append(("reset", self.name, job))


def _registry(log: list, *names: str) -> LoopHooks:
    hooks = LoopHooks()
    for name in names:
        hooks.register_hook(Recording(name, log), name)
    return hooks


def test_hooks_apply_in_order_come_off_in_reverse_and_only_where_applied():
    log: list = []
    hooks = _registry(log, "lora", "step_cache", "meter")
    hooks.apply("transformer", "model")
    hooks.apply("vae", "other", only=("meter",))
    assert log == [("apply", "lora", "transformer", "model"), ("apply", "step_cache", "transformer", "model"),
                   ("apply", "meter", "transformer", "model"), ("apply", "meter", "vae", "other")]
    assert hooks.applied == {"transformer": ["lora", "step_cache", "meter"], "vae": ["meter"]}
    log.clear()
    hooks.remove("transformer")
    hooks.remove("vae")
    hooks.remove("vae")  # not loaded any more: nothing to take off
    assert log == [("remove", "meter", "transformer"), ("remove", "step_cache", "transformer"),
                   ("remove", "lora", "transformer"), ("remove", "meter", "vae")]
    assert hooks.applied == {}


def test_reset_reaches_every_hook_in_order_with_the_job_or_none():
    log: list = []
    hooks = _registry(log, "lora", "step_cache")
    job = object()
    hooks.reset(job)
    hooks.reset()
    assert log == [("reset", "lora", job), ("reset", "step_cache", job), ("reset", "lora", None),
                   ("reset", "step_cache", None)]


def test_a_hook_registered_after_another_applies_right_after_it_and_names_are_unique():
    log: list = []
    hooks = _registry(log, "lora", "step_cache", "meter")
    hooks.register_hook(Recording("slice_end", log), "slice_end", after="step_cache")
    assert list(hooks.hooks) == ["lora", "step_cache", "slice_end", "meter"]
    hooks.apply("transformer", None, only=("step_cache", "slice_end", "meter"))
    assert [entry[1] for entry in log] == ["step_cache", "slice_end", "meter"]
    with pytest.raises(ValueError, match="already registered"):
        hooks.register_hook(Recording("meter", log), "meter")
    with pytest.raises(ValueError, match="No loop hook named nothing"):
        hooks.register_hook(Recording("x", log), "x", after="nothing")


def test_replace_keeps_the_place_and_remove_hook_takes_it_off_every_component():
    log: list = []
    hooks = _registry(log, "lora", "step_cache", "meter")
    own = Recording("own cache", log)
    hooks.replace_hook("step_cache", own)
    assert list(hooks.hooks) == ["lora", "step_cache", "meter"] and hooks["step_cache"] is own
    hooks.apply("transformer", None)
    hooks.apply("transformer_2", None)
    with pytest.raises(ValueError, match="on loaded components"):
        hooks.replace_hook("step_cache", Recording("late", log))
    log.clear()
    assert hooks.remove_hook("step_cache") is own and hooks.get_hook("step_cache") is None
    assert log == [("remove", "own cache", "transformer"), ("remove", "own cache", "transformer_2")]
    log.clear()
    hooks.remove("transformer")
    assert log == [("remove", "meter", "transformer"), ("remove", "lora", "transformer")]


def test_a_loop_registers_tiling_lora_step_cache_meter_and_under_simulate_the_split_check():
    from dm_cli.run.hooks.component_hooks import standard_hooks

    plan = SimpleNamespace(tiled_decode={}, loras=[], cache=None, step_cache={})
    loop = SimpleNamespace(plan=plan, family=None, loras=(), meter=None, simulate=False)
    assert list(standard_hooks(loop).hooks) == ["tiling", "lora", "step_cache", "meter"]
    loop.simulate = True
    assert list(standard_hooks(loop).hooks) == ["tiling", "lora", "step_cache", "meter", "split_check"]
