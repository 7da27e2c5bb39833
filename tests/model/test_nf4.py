"""--weights nf4: planned bytes are the bytes bitsandbytes' 4-bit loading really holds, by the libraries' own
loaders (transformers' from_pretrained with a BitsAndBytesConfig runs on this CPU; diffusers' refuses without a
GPU, so its environment check is bypassed here, in the test only), and the layers dmap quantizes are theirs."""

import json

import pytest

from dm_cli.errors import UsageError
from dm_cli.inputs import Generation, PlacementSpec
from dm_cli.model.formats.nf4 import nf4_bytes
from dm_cli.model.formats.weight_formats import int8_offload_problem, parse_weights_spec

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
bnb = pytest.importorskip("bitsandbytes")

from test_run import folders  # noqa: E402,F401


def test_parse_nf4():
    names = ["text_encoder", "text_encoder_2", "transformer", "vae"]
    assert parse_weights_spec("transformer=nf4,text_encoder_2=NF4", names) == {"transformer": "nf4", "text_encoder_2": "nf4"}
    assert parse_weights_spec("nf4", names) == {"text_encoder": "nf4", "text_encoder_2": "nf4", "transformer": "nf4"}
    with pytest.raises(UsageError, match="use fp8, int8, nf4 or none"):
        parse_weights_spec("fp4", names)
    assert int8_offload_problem("transformer", "nf4", {"a": 0, "b": "cpu"}).startswith("The plan offloads blocks")
    assert int8_offload_problem("transformer", "nf4", {"": "cpu"}) is None


def _held_bytes(model, skip=()) -> int:
    """Every parameter and buffer once, and the QuantState tensors of each Params4bit (absmax, quant map, and with
    double quantization the nested absmax, its map and the offset); `skip`: buffers left out."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for t in list(model.parameters()) + [b for n, b in model.named_buffers() if n not in skip]:
        add(t)
        state = getattr(t, "quant_state", None)
        if state is not None:
            add(state.absmax)
            add(state.code)
            if state.nested:
                for extra in (state.state2.absmax, state.state2.code, state.offset):
                    add(extra)
    return total


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", [(64, 128), (70, 200), (3, 5), (300, 1000)])
def test_nf4_bytes_is_what_params4bit_holds(shape, double_quant):
    layer = bnb.nn.Linear4bit(shape[1], shape[0], bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=double_quant)
    layer.load_state_dict({"weight": torch.randn(shape, dtype=torch.bfloat16)})
    layer = layer.to("cpu")
    assert layer.weight.dtype == torch.uint8
    assert _held_bytes(layer) == nf4_bytes(shape[0] * shape[1], double_quant)


def quantized_by_the_library(comp, folder, dtype=torch.bfloat16):
    """The component loaded with its library's own 4-bit NF4 loading (compute in `dtype`) on this CPU."""
    if comp.library == "diffusers":
        from diffusers.quantizers.bitsandbytes.bnb_quantizer import BnB4BitDiffusersQuantizer

        config = diffusers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        check = BnB4BitDiffusersQuantizer.validate_environment
        BnB4BitDiffusersQuantizer.validate_environment = lambda self, *a, **k: None  # it asks for a GPU
        try:
            return getattr(diffusers, comp.cls).from_pretrained(folder / comp.name, quantization_config=config,
                                                                  torch_dtype=dtype, device_map="cpu")
        finally:
            BnB4BitDiffusersQuantizer.validate_environment = check
    import transformers

    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return getattr(transformers, comp.cls).from_pretrained(folder / comp.name, quantization_config=config, dtype=dtype,
                                                           device_map="cpu")


@pytest.mark.parametrize("preset", ["tiny-flux", "tiny-sd3", "tiny-flux2", "tiny-qwenimage", "tiny-wan", "tiny-sdxl"])
def test_planned_bytes_and_layers_are_the_libraries(preset, folders):
    from dm_cli.model.skeleton import as_loaded
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    folder = folders(preset)
    source = resolve_source(str(folder))
    plan = make_plan(str(folder), PlanOptions(PlacementSpec("cpu=10GB", weights="nf4", dtype="bfloat16"),
                                              generation=Generation(height=0, width=0), check=False)).to_json()
    for name, planned in plan["components"].items():
        if name == "vae":
            assert planned["storage_dtype"] == "bfloat16"  # a bare nf4 leaves the VAE alone
            continue
        comp = source.component(name)
        model = quantized_by_the_library(comp, folder)
        theirs = {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
        skeleton = as_loaded(comp).skeleton
        ours = {t.name.rpartition(".")[0] for t in skeleton.tensors if "nf4" in t.low_precision}
        assert ours == theirs and theirs, f"{preset} {name}"
        assert planned["storage_dtype"] == "uint8"
        # non-persistent buffers (rotary inv_freq) come from the model's init, not the checkpoint: transformers'
        # 4-bit loading makes them float32 (16 bytes on tiny-flux2's Mistral-3), the plan counts the run dtype
        transient = {t.name for t in skeleton.tensors if t.kind == "buffer_np"}
        planned_np = sum(t.bytes_at("bfloat16", "nf4") for t in skeleton.tensors if t.kind == "buffer_np")
        assert planned["weights_bytes"] - planned_np == _held_bytes(model, transient), f"{preset} {name}"


def test_t5_keeps_wo_unquantized(folders):
    from dm_cli.model.skeleton import as_loaded
    from dm_cli.model.sources import resolve_source

    comp = resolve_source(str(folders("tiny-flux"))).component("text_encoder_2")
    tagged = {t.name for t in as_loaded(comp).skeleton.tensors if "nf4" in t.low_precision}
    assert tagged and not any(".wo." in n for n in tagged) and any(".wi." in n for n in tagged)


def test_inspect_and_plan_show_nf4_sizes():
    from typer.testing import CliRunner

    from dm_cli.cli import app

    spec = "transformer=nf4,text_encoder_2=nf4"
    result = CliRunner().invoke(app, ["inspect", "tiny-flux", "--weights", spec, "--json"])
    assert result.exit_code == 0, result.output
    comps = {c["name"]: c for c in json.loads(result.output)["components"]}
    assert comps["transformer"]["storage_dtype"] == "uint8" and comps["text_encoder"]["storage_dtype"] is None
    plain = {c["name"]: c for c in json.loads(CliRunner().invoke(app, ["inspect", "tiny-flux", "--json"]).output)["components"]}
    assert comps["transformer"]["bytes"] < plain["transformer"]["bytes"] / 3
    result = CliRunner().invoke(app, ["plan", "tiny-flux", "--weights", spec, "--max-memory", "cpu=1GB", "--height", "0",
                                      "--json"])
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output)["components"]
    assert planned["transformer"]["weights_bytes"] == comps["transformer"]["bytes"]
    assert planned["text_encoder_2"]["weights_bytes"] == comps["text_encoder_2"]["bytes"]


@pytest.mark.parametrize("preset,weights,memory,mode", [
    ("flux", "transformer=nf4,text_encoder_2=nf4", "0=16GB", "staged"),  # one 16 GB card, nothing offloaded
    ("flux", "transformer=nf4,text_encoder_2=nf4", "0=12GB,1=12GB", "resident"),
    ("qwen-image", "nf4", "0=16GB,1=16GB", "resident"),  # the 20B Qwen-Image on two 16 GB cards
])
def test_issue_goals_fit_at_1024(preset, weights, memory, mode):
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    plan = make_plan(preset, PlanOptions(PlacementSpec(memory, mode=mode, weights=weights),
                                         generation=Generation(height=1024, width=1024), check=False)).to_json()
    assert plan["mode"] == mode
    for name, comp in plan["components"].items():
        assert set(map(str, comp["device_map"].values())) <= {"0", "1"}, name  # nothing on cpu or disk
    assert plan["components"]["transformer"]["storage_dtype"] == "uint8"


def test_a_plan_that_does_not_fit_suggests_nf4_on_the_largest_component_and_the_hint_runs():
    import re

    from conftest import run_dmap

    asked = ["plan", "flux", "-q", "--max-memory", "0=12GB", "--mode", "staged", "--height", "1024", "--width", "1024"]
    code, _, err = run_dmap(*asked)
    assert code == 3 and "fits with --weights transformer=nf4" in err, err
    hint = re.search(r"fits with (--weights \S+?)[.]?(?: or |$)", err).group(1).split()
    code, out, err = run_dmap(*asked, *hint, "--json")
    assert code == 0, err
    assert json.loads(out)["components"]["transformer"]["storage_dtype"] == "uint8"
    # the user's own formats are kept in the hint; with the transformer in nf4 already, T5 is the largest
    code, _, err = run_dmap(*asked, "--weights", "text_encoder_2=fp8")
    assert code == 3 and "fits with --weights text_encoder_2=fp8,transformer=nf4" in err, err
    asked[4] = "0=8.5GB"
    code, _, err = run_dmap(*asked, "--weights", "transformer=nf4")
    assert code == 3 and "fits with --weights transformer=nf4,text_encoder_2=nf4" in err, err


def test_bench_nf4_small_prints_the_three_tables():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(repo / "scripts" / "bench_nf4.py"), "--small"], capture_output=True,
                          text=True, timeout=600, cwd=repo)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "flux transformer" in out and "0.28x" in out  # 6.70 GB of 23.80 GB
    assert "one 3072->12288 linear layer" in out and "dmap run, FLUX-architecture twin" in out
    assert out.count("nf4") >= 3


def test_bitsandbytes_kernels_compile_on_first_call_not_at_import():
    """bitsandbytes wraps its default kernels in torch.compile as they are defined, which imports inductor at every
    start of a process that imports diffusers; dmap imports it first with the compile deferred to each kernel's
    first call (issue 55: a whole `dmap run` stays ahead of `diffusers-cli run`)."""
    import subprocess
    import sys

    from dm_cli.model.formats.nf4 import _compile_on_first_call

    compiled = []

    def compile_now(model, **options):
        compiled.append((model, options))
        return lambda *args: ("compiled", model(*args))

    deferred = _compile_on_first_call(compile_now)
    double = deferred(lambda x: 2 * x, dynamic=False)
    triple = deferred(dynamic=True)(lambda x: 3 * x)  # the decorator form bitsandbytes uses
    assert compiled == []
    assert double(2) == ("compiled", 4) and double(3) == ("compiled", 6) and triple(1) == ("compiled", 3)
    assert [options for _, options in compiled] == [{"dynamic": False}, {"dynamic": True}]  # once each
    module = type("Model", (), {"forward": None, "__call__": lambda self: None})()
    deferred(module)
    assert compiled[-1][0] is module  # a module compiled at once, as before
    code = ("import sys, torch; compile_now = torch.compile\n"
            "from dm_cli.model.formats.nf4 import import_bitsandbytes_deferring_compile as first\n"
            "first(); import diffusers.quantizers\n"
            "print('bitsandbytes' in sys.modules, 'torch._inductor.compile_fx' in sys.modules, "
            "torch.compile is compile_now)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False", "True"]
