"""Overlapped offload in the plan (issue 55, item 2; planning/time/overlap.py, step_time.py): the predicted step counts
max(compute, transfer) per block instead of their sum, the memory model counts the prefetched block beside the
running one, and the plan says which it chose and why."""

import json
from types import SimpleNamespace

import pytest
from conftest import run_dmap
from test_step_time import hand_profile

from dm_cli.planning.placement.blocks import Block, ComponentInput
from dm_cli.planning.placement.placement import ComponentPlacement, DeviceUse, StagePlacement
from dm_cli.planning.placement.search import Device
from dm_cli.planning.plan_file import Plan
from dm_cli.planning.time.overlap import choose_overlap
from dm_cli.planning.time.step_time import CallWork, Traffic, call_terms, predict, unhidden_seconds

GB = 10**9


def test_overlapped_blocks_cost_the_larger_of_compute_and_transfer_not_their_sum():
    """Four blocks of the lists, 1 s of compute each (4e12 FLOPs at 1 TFLOP/s); the last three streamed at 4 GB/s.
    At 1 s of transfer each, every copy hides behind the block before it: the step is its compute, 4 s, where the
    synchronous path adds the 3 s of copies. At 2 s each, each streamed block costs max(1, 2) = 2 s: 1 + 3 x 2 = 7 s,
    not 4 + 6 = 10 s."""
    work = CallWork(matmul_flops=4e12, attention_flops=0, other_bytes=0, ops=0, weight_bytes=0, matmul_ops=4)
    profile = hand_profile()
    for transfer_s, overlapped_step, synchronous_step in ((1, 4.0, 7.0), (2, 7.0, 10.0)):
        nbytes = int(transfer_s * 4e9)
        streams = ((0, False, True),) + ((nbytes, True, True),) * 3
        overlapped = Traffic(offloaded_bytes=3 * nbytes, streams=streams)
        assert sum(call_terms(work, profile, "bfloat16", overlapped).values()) == pytest.approx(overlapped_step)
        synchronous = Traffic(offloaded_bytes=3 * nbytes)
        assert sum(call_terms(work, profile, "bfloat16", synchronous).values()) == pytest.approx(synchronous_step)
        result = predict(work, overlapped, profile, "bfloat16", calls=1, steps=1, images_per_call=1, queue=1)
        assert result["step_s"] == pytest.approx(overlapped_step)
        assert result["offload_overlap"] == {"synchronous_step_s": pytest.approx(synchronous_step),
                                             "transfer_s": pytest.approx(3 * transfer_s)}
    assert "offload_overlap" not in predict(work, Traffic(offloaded_bytes=4 * 10**9), profile, "bfloat16", 1, 1, 1, 1)


def test_a_first_streamed_block_with_nothing_before_it_waits_for_its_copy():
    """The first block's copy starts as the call starts: with no compute before it, its whole transfer shows; a
    synchronous block between overlapped ones waits for its own copy on the compute stream."""
    assert unhidden_seconds(((2.0, True, 1.0), (0.5, True, 1.0))) == pytest.approx(2.0)
    assert unhidden_seconds(((0.0, False, 3.0), (2.0, True, 1.0))) == pytest.approx(0.0)
    assert unhidden_seconds(((0.0, False, 1.0), (0.5, False, 1.0), (0.5, True, 1.0))) == pytest.approx(0.5)


def _plan(gpu_gb: float, device_map: dict, execution=0, disk_bytes=0):
    """A denoiser of four 1 GB blocks placed by hand: the GPU holds what `device_map` puts there, the running
    streamed block's reserve (1 GB) and 0.5 GB of activations."""
    spec = ComponentInput("dit", "Model", [Block(f"blocks.{i}", GB) for i in range(4)])
    on_gpu = sum(GB for device in device_map.values() if device == 0)
    offloaded = 4 * GB - on_gpu
    placed = ComponentPlacement("dit", "Model", 4 * GB, device_map, execution, {}, offloaded, 1, "denoise",
                                disk_bytes=disk_bytes)
    use = {"0": DeviceUse(weights=on_gpu, reserve=GB, activations=GB // 2)}
    plan = SimpleNamespace(components={"dit": placed}, stages=[StagePlacement("denoise", ["dit"], use)],
                           devices=[Device(0, int(gpu_gb * GB)), Device("cpu", 64 * GB), Device("disk", None)],
                           warnings=[])
    return plan, [spec]


def test_the_prefetched_block_is_counted_beside_the_running_one_where_it_fits():
    two_on_cpu = {"blocks.0": 0, "blocks.1": 0, "blocks.2": "cpu", "blocks.3": "cpu"}
    plan, specs = _plan(5, two_on_cpu)  # 2 GB of weights + 1 GB reserve + 0.5 GB activations: 1.5 GB free
    choose_overlap(plan, specs)
    offload = plan.components["dit"].offload
    assert offload["mode"] == "overlapped" and offload["prefetch_bytes"] == GB and offload["pinned_bytes"] == 2 * GB
    use = plan.stages[0].use["0"]
    assert use.reserve == 2 * GB and use.peak == int(4.5 * GB)  # the running block and the prefetched one
    assert "second stream" in offload["reason"]

    plan, specs = _plan(4, two_on_cpu)  # 0.5 GB free: the prefetched block does not fit
    choose_overlap(plan, specs)
    offload = plan.components["dit"].offload
    assert offload["mode"] == "synchronous" and offload["prefetch_bytes"] == 0
    assert "does not fit" in offload["reason"] and "500.00 MB short" in offload["reason"]
    assert plan.stages[0].use["0"].reserve == GB  # unchanged


def test_what_cannot_overlap_stays_synchronous_and_says_why():
    on_disk = {"blocks.0": 0, "blocks.1": 0, "blocks.2": "disk", "blocks.3": "disk"}
    plan, specs = _plan(8, on_disk, disk_bytes=2 * GB)
    choose_overlap(plan, specs)
    assert plan.components["dit"].offload["mode"] == "synchronous"
    assert "on disk" in plan.components["dit"].offload["reason"]
    plan, specs = _plan(8, {"blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "disk", "blocks.3": "disk"},
                        execution="cpu", disk_bytes=2 * GB)
    choose_overlap(plan, specs)
    assert "the cpu computes it" in plan.components["dit"].offload["reason"]
    # cpu and disk: the cpu blocks overlap, the disk ones stay in turn (said), the room is for the larger of both
    plan, specs = _plan(8, {"blocks.0": 0, "blocks.1": "disk", "blocks.2": "cpu", "blocks.3": "cpu"},
                        disk_bytes=GB)
    choose_overlap(plan, specs)
    offload = plan.components["dit"].offload
    assert offload["mode"] == "overlapped" and offload["pinned_bytes"] == 2 * GB and "on disk stay synchronous" in offload["reason"]


def test_the_plan_chooses_overlap_where_it_fits_and_is_faster_and_says_so():
    """The demo's transformer (45 MB) on a 40 MB GPU: the full GPU leaves no room for a prefetched block, so the
    plan offloads one block more, overlaps the copies, and keeps that because the time model predicts it faster;
    the plan file records the choice and reads it back."""
    from dm_cli.model.demo import ensure_demo

    args = ("plan", ensure_demo(), "--max-memory", "0=40MB,cpu=8GB", "--overhead", "0=0", "--height", 64, "--width", 64,
            "--profile", "table:rtx-4090")
    code, out, err = run_dmap(*args, "--json")
    assert code == 0, err
    data = json.loads(out)
    offload = data["components"]["transformer"]["offload"]
    assert offload["mode"] == "overlapped" and offload["prefetch_bytes"] > 0
    denoise = next(s for s in data["stages"] if "transformer" in s["components"])
    assert denoise["breakdown"]["0"]["reserve"] >= 2 * offload["prefetch_bytes"]  # two blocks of the same size
    assert denoise["peak_bytes"]["0"] <= data["devices"]["0"]["capacity_bytes"]
    predicted = data["predicted_time"]
    assert predicted["step_s"] < predicted["offload_overlap"]["synchronous_step_s"]
    assert any("more offloaded to leave room for the prefetched block" in w for w in data["warnings"])
    assert Plan.from_json(data).components["transformer"].offload == offload
    data["components"]["transformer"]["offload"]["mode"] = "sometimes"
    with pytest.raises(ValueError, match="offload mode must be overlapped or synchronous"):
        Plan.from_json(data)  # a plan file is input: a malformed choice refused
    code, out, _ = run_dmap(*args)
    text = " ".join(out.split())
    assert code == 0 and "overlapped: each block's copy from pinned RAM" in text
    assert "Offload overlapped with compute:" in text


# --- what composes with it (issue 55, item 2): Wan 2.2's two experts, the step caches, GGUF, the VAE -------------

WAN = ("--overhead", "0=0", "--height", 32, "--width", 32, "--frames", 9, "--profile", "table:rtx-4090", "--json")


def _offloads(data) -> dict:
    return {name: c.get("offload", {}).get("mode") for name, c in data["components"].items()}


def test_wan22s_two_experts_each_overlap_in_their_own_stage_and_the_vae_says_why_not():
    """tiny Wan 2.2 on a 0.5 MB GPU: the experts take turns (one denoise stage each), each streams its blocks with
    its prefetched block charged in its own stage; the VAE, which dmap places whole, goes to the cpu and says so."""
    code, out, err = run_dmap("plan", "tiny-wan", "--max-memory", "0=0.5MB,cpu=8GB", "--dtype", "fp32", *WAN)
    assert code == 0, err
    data = json.loads(out)
    assert _offloads(data)["transformer"] == _offloads(data)["transformer_2"] == "overlapped"
    denoise = [s for s in data["stages"] if s["name"] == "denoise"]
    assert [s["components"] for s in denoise] == [["transformer"], ["transformer_2"]]
    for stage, name in zip(denoise, ("transformer", "transformer_2")):
        offload = data["components"][name]["offload"]
        assert offload["prefetch_bytes"] > 0 and stage["breakdown"]["0"]["reserve"] >= 2 * offload["prefetch_bytes"]
        assert stage["peak_bytes"]["0"] <= data["devices"]["0"]["capacity_bytes"]
    vae = data["components"]["vae"]
    assert vae["device_map"] == {"": "cpu"} and vae["offload"]["mode"] == "synchronous"
    assert vae["offload"]["reason"].startswith("dmap places it whole (a VAE is never split, tiled or not)")


@pytest.mark.parametrize("cache", ["fbc", "taylorseer", "magcache"])
def test_a_step_cache_plan_leaves_room_for_the_prefetched_block_beside_the_caches_state(cache):
    """The demo's transformer on a 40 MB GPU with a step cache: as without one, the plan offloads a block more to
    leave the prefetched block room, now beside the cache's state (charged on the execution GPU), and overlaps."""
    from dm_cli.model.demo import ensure_demo

    code, out, err = run_dmap("plan", ensure_demo(), "--max-memory", "0=40MB,cpu=8GB", "--overhead", "0=0", "--height",
                              64, "--width", 64, "--profile", "table:rtx-4090", "--cache", cache, "--json")
    assert code == 0, err
    data = json.loads(out)
    offload = data["components"]["transformer"]["offload"]
    assert offload["mode"] == "overlapped", offload
    denoise = next(s for s in data["stages"] if "transformer" in s["components"])
    held = data["step_cache"]["components"]["transformer"]["bytes"]["0"]
    assert held > 0 and denoise["breakdown"]["0"]["cache"] == held
    assert denoise["breakdown"]["0"]["reserve"] >= 2 * offload["prefetch_bytes"]
    assert denoise["peak_bytes"]["0"] <= data["devices"]["0"]["capacity_bytes"]
    assert any("more offloaded to leave room for the prefetched block" in w for w in data["warnings"])
    assert data["predicted_time"]["step_s"] < data["predicted_time"]["offload_overlap"]["synchronous_step_s"]


def test_a_gguf_single_file_overlaps_its_quantized_blocks(tmp_path):
    """A GGUF single file (Q4_K and Q8_0 tensors, four blocks) standing in for Wan 2.2's transformer: its blocks, at
    their stored sizes, stream from pinned RAM one ahead of their turn."""
    import shutil

    from original_layouts import q8_0_rows, wan_name, write_gguf
    from safetensors.torch import load_file

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    configs = shutil.copytree(PRESETS_DIR / "tiny-wan", tmp_path / "configs")
    config = json.loads((configs / "transformer" / "config.json").read_text())
    (configs / "transformer" / "config.json").write_text(json.dumps({**config, "ffn_dim": 256, "num_layers": 4}))
    folder = write_random_pipeline(configs, tmp_path / "tiny-wan", seed=0)
    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    gguf = tmp_path / "wan-high-noise.gguf"
    write_gguf(gguf, {wan_name(k): v for k, v in state.items()}, "wan",
               lambda array: "Q4_K" if array.ndim == 2 and array.shape[1] % 256 == 0 else q8_0_rows(array))
    code, out, err = run_dmap("plan", gguf, "--pipeline", folder, "--max-memory", "0=0.5MB,cpu=8GB", *WAN)
    assert code == 0, err
    data = json.loads(out)
    transformer = data["components"]["transformer"]
    assert any("GGUF tensors" in w for w in data["warnings"])
    assert transformer["offload"]["mode"] == "overlapped" and transformer["offload"]["prefetch_bytes"] > 0
    assert transformer["offload"]["pinned_bytes"] == transformer["offloaded_bytes"]
