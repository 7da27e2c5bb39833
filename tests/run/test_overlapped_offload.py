"""Overlapped offload at run time (issue 55, item 2; run/load/prefetch.py): a component whose cpu blocks are fetched one
block ahead of their turn gives the synchronous path's pixels. On this CPU the execution device is the cpu, so the
prefetch path runs with its copies made at once on the one stream: the same hooks, the same order, the same values."""

import json

import diffusers
import numpy as np
import pytest
import torch
from conftest import run_dmap

SIZE = 64


@pytest.fixture(scope="module")
def demo():
    """(the transformer's map with every block streamed, its component source, the demo pipeline loaded once: each
    case swaps its own transformer in). The demo: FLUX.1's classes at laptop size, generated once per session."""
    from dm_cli.model.demo import ensure_demo
    from dm_cli.model.sources import resolve_source

    folder = ensure_demo()
    pipe = diffusers.FluxPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return _streamed_map(folder), resolve_source(str(folder)).component("transformer"), pipe


def _streamed_map(folder) -> dict:
    """The plan's transformer map (its blocks in execution order) with every block on the cpu: on a machine without
    a GPU the cpu is the execution device, and accelerate's hooks stream each block to it in its turn, as they stream
    cpu blocks to a GPU."""
    code, out, err = run_dmap("plan", folder, "--max-memory", "0=40MB,cpu=8GB", "--overhead", "0=0", "--height", SIZE,
                              "--width", SIZE, "--json")
    assert code == 0, err
    device_map = json.loads(out)["components"]["transformer"]["device_map"]
    assert len(device_map) > 2, device_map  # a split: each block its own entry
    return dict.fromkeys(device_map, "cpu")


def _image(pipe, transformer) -> np.ndarray:
    pipe.transformer = transformer
    return pipe("a fox", height=SIZE, width=SIZE, num_inference_steps=1, guidance_scale=3.5, output_type="np",
                max_sequence_length=64, generator=torch.Generator().manual_seed(3)).images[0]


def test_overlapped_offload_gives_the_synchronous_pixels(demo):
    from dm_cli.run.load.loading import _load_streamed, free_components

    device_map, comp, pipe = demo
    device_map = dict(device_map)
    synchronous = _load_streamed(comp, device_map, torch.float32)
    overlapped = _load_streamed(comp, device_map, torch.float32, overlap=True)
    prefetch = overlapped._dmap_prefetch
    assert not hasattr(synchronous, "_dmap_prefetch")
    modules = dict(overlapped.named_modules())
    assert prefetch.order == [key for key in device_map if key in modules]  # each cpu block, in execution order
    resident = pipe.transformer  # loaded whole by diffusers
    expected = _image(pipe, resident)
    assert np.array_equal(_image(pipe, synchronous), expected)
    assert np.array_equal(_image(pipe, overlapped), expected)
    pipe.transformer = resident
    # every block of each call arrived from a copy started ahead of its turn: 1 step, 1 call
    # (guidance-distilled), the first block's copy started by the component's own pre-hook
    assert prefetch.prefetched == len(prefetch.order)
    # accelerate's hooks inside the prefetched blocks skip the allocator flush (a device-wide sync on a GPU)
    from accelerate.hooks import AlignDevicesHook
    from accelerate.utils import modeling

    from dm_cli.run.load.prefetch import no_cache_flush, quiet_hook_class

    hooks = [m._hf_hook for m in overlapped.get_submodule(prefetch.order[-1]).modules()
             if isinstance(getattr(m, "_hf_hook", None), AlignDevicesHook)]
    assert hooks and all(type(hook) is quiet_hook_class() for hook in hooks)
    flush = modeling.clear_device_cache
    with no_cache_flush():
        assert modeling.clear_device_cache is not flush
    assert modeling.clear_device_cache is flush
    weight = next(overlapped.parameters())
    assert weight.device.type == "meta"  # between calls the weights are dropped, as in the synchronous path
    free_components([overlapped])
    assert prefetch._host == {} and prefetch._ready == {}  # its host copies let go with the component


def test_only_cpu_blocks_are_prefetched_disk_ones_stay_in_turn(demo):
    """Blocks on disk are read from the checkpoint on each use (no pinned copy): the mapping serves them from its
    base, in their turn, and prefetches the cpu ones around them."""
    from dm_cli.run.load.loading import _load_streamed

    device_map, comp, pipe = demo
    device_map = dict(device_map)
    resident = pipe.transformer
    expected = _image(pipe, resident)
    device_map["transformer_blocks.0"] = "disk"
    model = _load_streamed(comp, device_map, torch.float32, overlap=True)
    order = model._dmap_prefetch.order
    assert "transformer_blocks.0" not in order and "single_transformer_blocks.0" in order
    assert np.array_equal(_image(pipe, model), expected)
    pipe.transformer = resident


def test_fp8_blocks_prefetched_give_the_synchronous_fp8_pixels(demo):
    """--weights fp8: the host copies are the fp8 values the synchronous path reads from the checkpoint each call
    (read, cast to the run dtype, stored in fp8), so the prefetched blocks compute the same image."""
    from dm_cli.run.load.loading import _load_streamed

    device_map, comp, pipe = demo
    resident = pipe.transformer
    synchronous = _load_streamed(comp, device_map, torch.float32, "fp8")
    overlapped = _load_streamed(comp, device_map, torch.float32, "fp8", overlap=True)
    assert overlapped._dmap_prefetch.order
    expected = _image(pipe, synchronous)
    assert np.array_equal(_image(pipe, overlapped), expected)
    assert overlapped._dmap_prefetch.prefetched == len(overlapped._dmap_prefetch.order)
    pipe.transformer = resident


def test_dmap_run_follows_a_plan_that_overlaps_and_makes_the_same_image(demo, tmp_path, monkeypatch):
    """The whole run path: `dmap run -d PLAN.json` whose transformer streams its blocks (cpu ones and a disk one, to
    the cpu that computes here) with `offload.mode` overlapped loads it through the prefetch path and writes the
    image the same plan without the key writes."""
    from test_run import _png, hand_plan

    from dm_cli.model.demo import ensure_demo

    device_map, _, _ = demo
    folder = ensure_demo()
    plan = hand_plan(folder)
    plan["components"]["transformer"]["device_map"] = {**device_map, "transformer_blocks.0": "disk"}
    from dm_cli.run.load import loading

    attached, attach = [], loading.attach_prefetch
    monkeypatch.setattr(loading, "attach_prefetch", lambda model, weights: (attached.append(len(weights.order)),
                                                                            attach(model, weights)))
    images = []
    for overlapped in (False, True):
        if overlapped:
            plan["components"]["transformer"]["offload"] = {"mode": "overlapped", "reason": "a test's",
                                                            "prefetch_bytes": 0, "pinned_bytes": 0}
        path, out = tmp_path / f"plan-{overlapped}.json", tmp_path / f"fox-{overlapped}.png"
        path.write_text(json.dumps(plan))
        code, _, err = run_dmap("run", folder, "-d", path, "--prompt", "a fox", "--steps", 1, "--seed", 3, "-o", out)
        assert code == 0, err
        assert bool(attached) == overlapped  # the prefetch path, and only where the plan says so
        images.append(_png(out)[0])
    assert np.array_equal(images[0], images[1]) and attached[0] == len(device_map) - 1  # every cpu block but disk's


def test_an_unfused_lora_on_prefetched_blocks_gives_the_synchronous_pixels(demo, tmp_path):
    """A LoRA on streamed layers stays unfused, its adapters streamed with their layers by hooks as quiet as the
    layers' (no allocator flush on each set): the overlapped blocks compute the synchronous path's image."""
    from dataclasses import replace

    from accelerate.hooks import AlignDevicesHook
    from test_lora import make_lora

    from dm_cli.model.demo import ensure_demo
    from dm_cli.model.lora import read_lora
    from dm_cli.run.hooks.adapters import load_loras
    from dm_cli.run.load.loading import _load_streamed
    from dm_cli.run.load.prefetch import quiet_hook_class

    device_map, comp, pipe = demo
    resident = pipe.transformer
    folder = ensure_demo()
    lora = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", tmp_path / "lora.safetensors",
                     diffusers.FluxPipeline, seed=1)
    adapter = replace(read_lora(f"{lora}:0.7"), component="transformer")
    images = []
    for overlap in (False, True):
        model = _load_streamed(comp, device_map, torch.float32, overlap=overlap)
        load_loras(pipe, "transformer", model, (adapter,), torch.float32)
        images.append(_image(pipe, model))
    to_q = model.get_submodule(model._dmap_prefetch.order[-4]).attn.to_q
    assert type(to_q.lora_A["dmap_lora_0"]._hf_hook) is quiet_hook_class()
    assert isinstance(to_q.lora_A["dmap_lora_0"]._hf_hook, AlignDevicesHook)
    assert np.array_equal(images[0], images[1])
    pipe.transformer = resident
