"""Overlapped offload at run time (issue 55, item 2; run/load/prefetch.py): a component whose cpu blocks are fetched one
block ahead of their turn gives the synchronous path's pixels. On this CPU the execution device is the cpu, so the
prefetch path runs with its copies made at once on the one stream: the same hooks, the same order, the same values."""

import json

import diffusers
import numpy as np
import pytest
import torch
from conftest import run_dmap, wan_transformer_inputs
from test_single_file_run import wan_files  # noqa: F401 - a fixture: a tiny Wan 2.2 and its GGUF single file

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


# --- what composes with it: Wan 2.2's two experts, the step caches, a GGUF single file (issue 55, item 2) ----------


def _streamed_plan(plan: dict, names: dict[str, list[str]], overlapped: bool) -> dict:
    """`plan` (a dmap plan JSON made for the cpu) with each component of `names` streaming those blocks: the first
    from disk (so that the map is not all cpu, which loads resident), the others from the cpu; the cpu computes them
    here, through accelerate's offload hooks, as they stream to a GPU. `overlapped`: its offload.mode says so."""
    plan = json.loads(json.dumps(plan))
    for name, blocks in names.items():
        component = plan["components"][name]
        component["device_map"] = {"": "cpu", **dict.fromkeys(blocks, "cpu"), blocks[0]: "disk"}
        if overlapped:
            component["offload"] = {"mode": "overlapped", "reason": "a test's", "prefetch_bytes": 0, "pinned_bytes": 0}
        else:
            component.pop("offload", None)
    return plan


def _run_both(folder, plan: dict, names: dict[str, list[str]], tmp_path, monkeypatch, *run_args, output="out.png"):
    """`dmap run -d` with the plan streaming `names` synchronously, then overlapped: (the two outputs, the prefetch
    path's attachments in each run as (class, blocks prefetched))."""
    from dm_cli.run.load import loading

    attached, attach = [], loading.attach_prefetch

    def counted(model, weights):
        attached.append((type(model).__name__, weights))
        attach(model, weights)

    monkeypatch.setattr(loading, "attach_prefetch", counted)
    outputs, runs = [], []
    for overlapped in (False, True):
        path, out = tmp_path / f"plan-{overlapped}.json", tmp_path / f"{overlapped}-{output}"
        path.write_text(json.dumps(_streamed_plan(plan, names, overlapped)))
        code, stdout, err = run_dmap("run", folder, "-d", path, "--seed", 3, "-o", out, "--json", *run_args)
        assert code == 0, err
        outputs.append((out, json.loads(stdout)))
        runs.append([(cls, len(weights.order), weights.prefetched) for cls, weights in attached])
        attached.clear()
    return outputs, runs


def _frames(folder) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.open(p)) for p in sorted(folder.glob("frame-*.png"))])


def test_wan22s_two_experts_prefetched_give_the_synchronous_frames(tmp_path, monkeypatch):
    """Wan 2.2: each expert (transformer, transformer_2) streams its blocks with its own prefetch, in its own turn
    of the steps (the high-noise expert first, the low-noise one after the boundary): the same frames."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    folder = write_random_pipeline(PRESETS_DIR / "tiny-wan", tmp_path / "tiny-wan", seed=0)
    args = ("--height", 32, "--width", 32, "--frames", 9, "--dtype", "fp32")
    code, out, err = run_dmap("plan", folder, "--max-memory", "cpu=8GB", *args, "--json")
    assert code == 0, err
    experts = {"transformer": ["blocks.0", "blocks.1", "proj_out"], "transformer_2": ["blocks.0", "blocks.1", "proj_out"]}
    ((synchronous, _), (overlapped, _)), runs = _run_both(folder, json.loads(out), experts, tmp_path, monkeypatch,
                                                          "--prompt", "a fox", "--steps", 4, output="frames/")
    assert runs[0] == []  # the synchronous plan never takes the prefetch path
    # both experts prefetched, each its two cpu blocks (blocks.1, proj_out) every call of its steps
    assert [(cls, order) for cls, order, _ in runs[1]] == [("WanTransformer3DModel", 2)] * 2
    assert all(prefetched >= 2 * order for _, order, prefetched in runs[1])
    assert np.array_equal(_frames(overlapped), _frames(synchronous))


@pytest.mark.parametrize("cache", ["fbc:threshold=0.6", "taylorseer", "magcache"])
def test_a_step_cache_on_prefetched_blocks_gives_the_synchronous_pixels(demo, cache, tmp_path, monkeypatch):
    """A step cache's hooks skip blocks on the steps they reuse: a skipped block's prefetched copy is dropped unused
    when the next block takes its own, and the blocks that run read the values they read in turn. The cache skips as
    many calls either way, and the image is the synchronous path's."""
    from dm_cli.io.outputs import read_metadata
    from dm_cli.model.demo import ensure_demo

    device_map, _, _ = demo
    folder = ensure_demo()
    code, out, err = run_dmap("plan", folder, "--max-memory", "cpu=8GB", "--height", SIZE, "--width", SIZE,
                              "--steps", 6, "--cache", cache, "--json")
    assert code == 0, err
    blocks = [key for key in device_map if key.startswith(("transformer_blocks", "single_transformer_blocks"))]
    ((synchronous, before), (overlapped, after)), runs = _run_both(folder, json.loads(out), {"transformer": blocks},
                                                                   tmp_path, monkeypatch, "--prompt", "a fox")
    assert runs[0] == [] and [(cls, order) for cls, order, _ in runs[1]] == [("FluxTransformer2DModel", len(blocks) - 1)]
    assert np.array_equal(_png(overlapped), _png(synchronous))
    assert read_metadata(str(overlapped))["step_cache"] == read_metadata(str(synchronous))["step_cache"]
    counts = after["step_cache"]["counts"]["transformer"]
    assert counts == before["step_cache"]["counts"]["transformer"] and counts["skipped"] > 0 and counts["computed"] > 0


def _png(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image)


def test_gguf_blocks_prefetched_keep_their_types_and_give_the_synchronous_output(wan_files):
    """A GGUF single file (Q8_0 and Q4_K tensors): its cpu blocks' host copies are the GGUF parameters themselves
    (their quant type kept, dequantized per layer as they run), prefetched as the plain ones are: the same output."""
    from dm_cli.run.load.loading import dispatch_loaded

    folder, _, gguf_file = wan_files

    def loaded(overlap):
        model = diffusers.WanTransformer3DModel.from_single_file(
            str(gguf_file), config=str(folder), subfolder="transformer", torch_dtype=torch.float32,
            local_files_only=True, quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32))
        return dispatch_loaded(model, {"": "cpu", "blocks.0": "cpu", "blocks.1": "cpu"}, overlap)

    synchronous, overlapped = loaded(False), loaded(True)
    prefetch = overlapped._dmap_prefetch
    assert prefetch.order == ["blocks.0", "blocks.1"]
    assert overlapped.blocks[0].ffn.net[2].weight.quant_type is not None  # still a GGUF layer
    inputs = wan_transformer_inputs(synchronous.config)
    with torch.no_grad():
        expected, got = synchronous(*inputs).sample, overlapped(*inputs).sample
    assert torch.equal(got, expected) and prefetch.prefetched == 2


def test_host_copies_are_pinned_only_where_they_keep_their_type(monkeypatch):
    """On CUDA the cpu blocks' host copies are pinned: plain tensors always; a tensor subclass (a GGUF parameter)
    only where `pin_memory` gives it back of its own class with its quant type, else it is kept as it is."""
    from dm_cli.run.load.prefetch import pinned

    class Quantized(torch.Tensor):
        quant_type = 8

    class Pins(Quantized):
        def pin_memory(self):  # stands in for the page-locked copy (CPU-only torch cannot pin)
            return torch.Tensor._make_subclass(Pins, torch.Tensor._make_subclass(torch.Tensor, self).clone())

    class Loses(Quantized):
        def pin_memory(self):
            return torch.Tensor._make_subclass(torch.Tensor, self)

    class Refuses(Quantized):
        def pin_memory(self):
            raise RuntimeError("cannot pin")

    for cls in (Pins, Loses, Refuses):
        value = torch.Tensor._make_subclass(cls, torch.zeros(2))
        host = pinned(value)
        assert type(host) is cls and host.quant_type == 8 and (host is not value) == (cls is Pins), cls
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    plain = torch.ones(2)
    assert pinned(plain) is not plain and torch.equal(pinned(plain), plain)
