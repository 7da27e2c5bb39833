"""--weights fp8 / int8: planned bytes are the bytes diffusers' layerwise casting and torchao really
allocate, the compute copy is in the peak, and `dmap run` gives the pixels of diffusers' own pipeline
with the same components cast."""

import json

import numpy as np
import pytest

from dm_cli.errors import UsageError
from dm_cli.inputs import PlacementSpec
from dm_cli.model.formats.weight_formats import parse_weights_spec

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from test_run import PROMPT, SEED, SIZE, STEPS, _png, _units, dmap_run, folders, hand_plan  # noqa: E402,F401

STORAGE = {"fp8": "float8_e4m3fn", "int8": "int8"}


def test_parse_weights_spec():
    names = ["text_encoder", "transformer", "vae"]
    assert parse_weights_spec("fp8", names) == {"text_encoder": "fp8", "transformer": "fp8"}
    assert parse_weights_spec("transformer=int8", names) == {"transformer": "int8"}
    assert parse_weights_spec("fp8,text_encoder=none,vae=fp8", names) == {
        "text_encoder": None, "transformer": "fp8", "vae": "fp8"}
    assert parse_weights_spec(None, names) == {}
    assert parse_weights_spec("fp8,text_encoder=bfloat16,vae=half", names)["text_encoder"] is None  # as --dtype spells them
    with pytest.raises(UsageError, match="unet.*lacks"):
        parse_weights_spec("unet=fp8", names)
    with pytest.raises(UsageError, match="Unknown weight format 'fp4'"):
        parse_weights_spec("fp4", names)


def _build(comp, dtype):
    """The component with random weights at `dtype`, built by its library."""
    if comp.library == "diffusers":
        return getattr(diffusers, comp.cls).from_config(comp.config).to(dtype)
    import transformers

    cls = getattr(transformers, comp.cls)
    config = cls.config_class.from_dict({k: v for k, v in comp.config.items() if k not in ("_name_or_path", "transformers_version")})
    return cls(config).to(dtype)


def _cast_like_diffusers(model, compute):
    """diffusers' own API, independently of dmap: enable_layerwise_casting, or apply_layerwise_casting with
    the same pattern list for a transformers model."""
    from diffusers.hooks import apply_layerwise_casting
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    if isinstance(model, diffusers.ModelMixin):
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute)
    else:
        keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ()) + tuple(
            getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        apply_layerwise_casting(model, torch.float8_e4m3fn, compute, DEFAULT_SKIP_MODULES_PATTERN + keep)


def _fp8_like_diffusers(model, compute):
    """As `_cast_like_diffusers`, and a transformers model reports the compute dtype (the pipelines cast
    prompt embeddings to `text_encoder.dtype`, which would now be the fp8 of its first parameter)."""
    _cast_like_diffusers(model, compute)
    if not isinstance(model, diffusers.ModelMixin):
        cls = type(model)
        model.__class__ = type(cls.__name__, (cls,), {"dtype": property(lambda _self: compute)})


def _skip_patterns(model) -> tuple:
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    return (tuple(DEFAULT_SKIP_MODULES_PATTERN) + tuple(getattr(model, "_skip_layerwise_casting_patterns", None) or ())
            + tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
            + tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ()))


def _quantize_int8(model, name, source):
    """torchao on the nn.Linear layers layerwise casting would store low: none under a module a skip pattern
    names, none whose weight is tied to another module's (chosen here from the model, not from dmap)."""
    import re

    from dm_cli.model.formats.weight_formats import torchao

    quantize_, config = torchao()
    patterns = _skip_patterns(model)
    owners: dict[int, int] = {}
    for _, module in model.named_modules():
        for param in module._parameters.values():
            if param is not None:
                owners[id(param)] = owners.get(id(param), 0) + 1

    def chosen(module, fqn: str) -> bool:
        parts = fqn.split(".")
        kept = any(re.search(p, ".".join(parts[:i])) for p in patterns for i in range(1, len(parts) + 1))
        return isinstance(module, torch.nn.Linear) and not kept and owners.get(id(module.weight), 0) == 1

    assert any(chosen(m, n) for n, m in model.named_modules() if n), name
    quantize_(model, config(), filter_fn=chosen)


def _real_bytes(model) -> int:
    """Bytes of every parameter and buffer once (the inner tensors of torchao's int8 weights)."""
    from dm_cli.run.load.meter import plain_tensors

    seen, total = set(), 0
    for outer in list(model.parameters()) + list(model.buffers()):
        for t in plain_tensors(outer):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("preset", ["tiny-flux", "tiny-sd3", "tiny-flux2"])
def test_planned_bytes_are_the_bytes_after_casting(preset, fmt):
    from dm_cli.inputs import Generation
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    source = resolve_source(preset)
    plan = make_plan(preset, PlanOptions(PlacementSpec("cpu=10GB", weights=f"{fmt},vae={fmt}"), generation=Generation(height=0, width=0), check=False)).to_json()
    for name, planned in plan["components"].items():
        model = _build(source.component(name), torch.bfloat16)
        if fmt == "fp8":
            _cast_like_diffusers(model, torch.bfloat16)
        else:
            _quantize_int8(model, name, source)
        assert planned["storage_dtype"] == STORAGE[fmt]
        assert planned["weights_bytes"] == _real_bytes(model), f"{preset} {name} {fmt}"
        if fmt == "fp8":  # int8's per-row scales outweigh the savings on the tiny VAE's 4-wide layers
            assert planned["weights_bytes"] < _real_bytes(_build(source.component(name), torch.bfloat16))


def test_compute_copy_of_the_largest_layer_is_in_the_peak():
    from dm_cli.inputs import Generation
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    generation = Generation(height=64, width=64)
    plain = make_plan("tiny-flux", PlanOptions(PlacementSpec("cpu=10GB"), generation=generation, check=False)).to_json()
    fp8 = make_plan("tiny-flux", PlanOptions(PlacementSpec("cpu=10GB", weights="fp8"), generation=generation, check=False)).to_json()
    model = _build(resolve_source("tiny-flux").component("transformer"), torch.bfloat16)
    _cast_like_diffusers(model, torch.bfloat16)
    largest = max(sum(p.numel() * 2 for p in m.parameters(recurse=False)) for m in model.modules()
                  if any(p.dtype == torch.float8_e4m3fn for p in m.parameters(recurse=False)))
    assert largest > 0
    peak = lambda plan: plan["components"]["transformer"]["activation_peak_bytes"]  # noqa: E731
    assert peak(fp8) == peak(plain) + largest
    assert fp8["components"]["vae"]["storage_dtype"] == "bfloat16"  # a bare fp8 leaves the VAE alone


def test_inspect_weights_matches_plan():
    from typer.testing import CliRunner

    from dm_cli.cli import app

    result = CliRunner().invoke(app, ["inspect", "tiny-sd3", "--weights", "transformer=fp8", "--json"])
    assert result.exit_code == 0, result.output
    comps = {c["name"]: c for c in json.loads(result.output)["components"]}
    assert comps["transformer"]["storage_dtype"] == "float8_e4m3fn" and comps["vae"]["storage_dtype"] is None
    assert comps["transformer"]["dtype"] == "float8_e4m3fn"
    result = CliRunner().invoke(app, ["plan", "tiny-sd3", "--weights", "transformer=fp8", "--max-memory", "cpu=1GB",
                                      "--height", "0", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["components"]["transformer"]["weights_bytes"] == comps["transformer"]["bytes"]
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    with pytest.raises(UsageError, match="names component 'unet'"):
        make_plan("tiny-sd3", PlanOptions(PlacementSpec("cpu=1GB", weights="unet=fp8")))


def oracle(folder, fmt, dtype):
    """diffusers' pipeline with the same components cast: layerwise casting (diffusers' API) or torchao."""
    from dm_cli.model.sources import resolve_source
    source = resolve_source(str(folder))
    compute = getattr(torch, dtype)
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=compute)
    pipe.set_progress_bar_config(disable=True)
    for name, comp in pipe.components.items():
        if fmt and isinstance(comp, torch.nn.Module) and name != "vae":
            if fmt == "int8":
                _quantize_int8(comp, name, source)
            elif isinstance(comp, diffusers.ModelMixin):
                comp.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute)
            else:  # transformers text encoders: the same hooks, reporting the compute dtype
                _fp8_like_diffusers(comp, compute)
    image = pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                 height=SIZE, width=SIZE).images[0]
    return np.array(image)


def _with_storage(plan, fmt, dtype):
    plan["dtype"] = dtype
    for name, comp in plan["components"].items():
        comp["storage_dtype"] = STORAGE[fmt] if name != "vae" else dtype
    return plan


@pytest.mark.parametrize("preset,fmt,dtype", [("tiny-flux", "fp8", "float32"), ("tiny-sd3", "fp8", "bfloat16"),
                                              ("tiny-flux", "int8", "bfloat16")])
def test_run_is_pixel_identical_to_diffusers_with_the_same_casting(preset, fmt, dtype, folders, tmp_path):
    from dm_cli.run.request import LOAD_RSS_MARGIN_BYTES, RunRequest
    from dm_cli.run.sessions.single import run

    folder = folders(preset)
    expected = oracle(folder, fmt, dtype)
    # planned here by dmap (unsplit on the cpu), then a 2-device split under --simulate
    unsplit = run(RunRequest.of(source=str(folder), prompt=PROMPT, max_memory="cpu=4GB", steps=STEPS, height=SIZE,
                             width=SIZE, seed=SEED, output=str(tmp_path / "a.png"), dtype=dtype, weights=fmt))
    assert {c["storage_dtype"] for n, c in unsplit.plan.to_json()["components"].items() if n != "vae"} == {STORAGE[fmt]}
    split = dmap_run(folder, _with_storage(hand_plan(folder, 2), fmt, dtype), tmp_path, simulate=True, name="b.png")
    assert split.split_check and split.split_problems == []
    for name in ("a.png", "b.png"):
        assert np.array_equal(_png(tmp_path / name)[0], expected), f"{preset} {fmt} {dtype} {name}"
    for stage in unsplit.stages:  # low-precision loading is one tensor at a time too
        kept = sum(stage.resident_after_load.values())
        assert stage.load_rss_delta - kept <= stage.largest_shard + LOAD_RSS_MARGIN_BYTES


@pytest.mark.parametrize("fmt", [None, "fp8"])
def test_bf16_blocks_streamed_from_cpu_and_disk_are_identical(fmt, folders, tmp_path):
    """Streamed blocks load in the plan's dtype (bf16 runs used to fail: they came back as float32)."""
    folder = folders("tiny-flux")
    plan = _with_storage(hand_plan(folder), fmt, "bfloat16") if fmt else {**hand_plan(folder), "dtype": "bfloat16"}
    units = _units(diffusers.FluxTransformer2DModel.from_config(
        diffusers.FluxTransformer2DModel.load_config(folder / "transformer")))
    plan["components"]["transformer"]["device_map"] = {u: ("disk" if i % 2 else "cpu") for i, u in enumerate(units)}
    dmap_run(folder, plan, tmp_path)
    assert np.array_equal(_png(tmp_path / "out.png")[0], oracle(folder, fmt, "bfloat16"))
    assert not list(folder.rglob("*.dat"))


def test_run_refuses_a_plan_with_other_storage_and_int8_offload(folders, tmp_path, monkeypatch):
    folder = folders("tiny-flux")
    plan = _with_storage(hand_plan(folder), "fp8", "float32")
    with pytest.raises(UsageError, match=r"stores '\w+' as float8_e4m3fn, this run asks for float32"):
        dmap_run(folder, plan, tmp_path, weights="none")
    with pytest.raises(UsageError, match="stores 'transformer' as float32, this run asks for int8"):
        dmap_run(folder, hand_plan(folder), tmp_path, weights="transformer=int8")
    offloaded = _with_storage(hand_plan(folder), "int8", "float32")
    offloaded["components"]["transformer"]["device_map"] = {"": "disk"}
    import dm_cli.run.loops.stages

    loaded = []  # refused before any stage loads (it was refused only when the transformer's stage came)
    monkeypatch.setattr(dm_cli.run.loops.stages, "load_component", lambda comp, *a, **k: loaded.append(comp.name) or 1 / 0)
    with pytest.raises(UsageError, match="int8 weights cannot be streamed"):
        dmap_run(folder, offloaded, tmp_path)
    assert not loaded and not (tmp_path / "out.png").exists()


def test_int8_without_torchao_plans_and_refuses_to_run(folders, tmp_path, monkeypatch):
    import sys

    from dm_cli.inputs import Generation
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    plan = make_plan("tiny-flux", PlanOptions(PlacementSpec("cpu=1GB", weights="int8"), generation=Generation(height=0, width=0), check=False))
    assert plan.to_json()["components"]["transformer"]["storage_dtype"] == "int8"
    folder = folders("tiny-flux")
    with pytest.raises(UsageError, match="--weights int8 needs torchao"):
        dmap_run(folder, _with_storage(hand_plan(folder), "int8", "float32"), tmp_path)


def test_shard_fp8_writes_a_checkpoint_diffusers_loads_dmap_plans_from_and_runs(folders, tmp_path):
    from dm_cli.inputs import Generation
    from dm_cli.io.checkpoint import open_checkpoint
    from dm_cli.model.shard import shard
    from dm_cli.model.skeleton import skeleton_for_component
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    folder = folders("tiny-flux")
    out = tmp_path / "fp8"
    result = shard(str(folder), 0, output=str(out), dtype="fp8")
    assert result.dtype == "float8_e4m3fn" and result.verified
    original, written = resolve_source(str(folder)), resolve_source(str(out))
    for comp in written.components:
        skeleton, _ = skeleton_for_component(original.component(comp.name))
        cast = {t.name for t in skeleton.tensors if "fp8" in t.low_precision}
        cast |= {a for g in skeleton.tie_groups if g[0] in cast for a in g[1:]}
        header = open_checkpoint(comp.weights).tensors
        fp8 = {n for n, e in header.items() if e.dtype == "float8_e4m3fn"}
        assert fp8 == (set() if comp.name == "vae" else cast & set(header)), comp.name
        assert {e.dtype for n, e in header.items() if n not in fp8} <= {"float32", "int64"}  # skipped modules kept
    plan = make_plan(str(out), PlanOptions(PlacementSpec("cpu=1GB"), generation=Generation(height=0, width=0), check=False)).to_json()
    assert plan["dtype"] == "float32"
    for comp in written.components:  # planned from the checkpoint's real sizes, fp8 found without --weights
        skeleton, checkpoint = skeleton_for_component(comp)
        non_persistent = sum(t.bytes_at(None) for t in skeleton.tensors if t.kind == "buffer_np")
        planned = plan["components"][comp.name]
        assert planned["weights_bytes"] == sum(e.nbytes for e in checkpoint.tensors.values()) + non_persistent
        assert planned["storage_dtype"] == ("float32" if comp.name == "vae" else "float8_e4m3fn")
    run(RunRequest.of(source=str(out), prompt=PROMPT, max_memory="cpu=4GB", steps=STEPS, height=SIZE, width=SIZE,
                   seed=SEED, output=str(tmp_path / "fp8.png")))
    pixels = _png(tmp_path / "fp8.png")[0]
    assert np.array_equal(pixels, oracle(out, "fp8", "float32"))  # diffusers loads the fp8 checkpoint
    assert np.array_equal(pixels, oracle(folder, "fp8", "float32"))  # and it holds what --weights fp8 would cast


def test_tiny_flux2_fp8_run_is_pixel_identical_unsplit_and_split(folders, tmp_path):
    """FLUX.2 (Mistral-3 text encoder, Flux2 transformer): dmap run --weights fp8 vs diffusers' Flux2Pipeline
    with enable_layerwise_casting on the transformer and the same hooks on the text encoder."""
    from test_flux2 import TOKENS, diffusers_pipeline, split_plan

    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run
    folder = folders("tiny-flux2")
    pipe = diffusers_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    _fp8_like_diffusers(pipe.text_encoder, torch.float32)
    expected = np.array(pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                             height=SIZE, width=SIZE, max_sequence_length=TOKENS, text_encoder_out_layers=(1,)).images[0])
    run(RunRequest.of(source=str(folder), prompt=PROMPT, max_memory="cpu=8GB", steps=STEPS, height=SIZE, width=SIZE,
                   seed=SEED, output=str(tmp_path / "a.png"), weights="fp8", max_sequence_length=TOKENS))
    split = dmap_run(folder, _with_storage(split_plan(folder, 2), "fp8", "float32"), tmp_path, simulate=True,
                     name="b.png")
    assert split.split_check and split.split_problems == []
    for name in ("a.png", "b.png"):
        assert np.array_equal(_png(tmp_path / name)[0], expected), name


def test_a_stored_fp8_file_without_config_is_inspected_and_planned_as_stored(tmp_path):
    """No config: which layers a run would cast is unknown, so the bytes are the file's (plan refused it)."""
    import torch
    from conftest import run_dmap
    from safetensors.torch import save_file

    path = tmp_path / "fp8.safetensors"
    save_file({"a.weight": torch.ones(64, 64).to(torch.float8_e4m3fn), "a.norm": torch.ones(64)}, str(path))
    code, out, err = run_dmap("inspect", path, "--json")
    assert code == 0, err
    code, out, err = run_dmap("plan", path, "-m", "cpu=1GB", "--json")
    assert code == 0, err
    assert json.loads(out)["components"]["fp8"]["weights_bytes"] == 64 * 64 + 64 * 4
    code, _, err = run_dmap("plan", path, "-m", "cpu=1GB", "--weights", "fp8")
    assert code == 2 and "needs the config" in err
