"""The planner's own split of the LTX-2 transformer: its root modulates the output of the weightless norm_out with its
own scale_shift_table and time_embed's output, without moving either (diffusers 0.42.1), so a cut between its blocks
needs a hook on norm_out beside the root's tensors. The plan gives norm_out (and audio_norm_out) that key; the split
check passes and a run under --simulate is pixel- and audio-identical to diffusers' LTX2Pipeline."""

import json

import numpy as np
import pytest
from test_ltx2 import FRAMES, _run, folder, hand_plan, oracle  # noqa: F401  (fixtures)

torch = pytest.importorskip("torch")


def planned_transformer_map(folder) -> dict:
    from dm_cli.inputs import Generation, PlacementSpec
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    # weights only (the tiny twin's activations are MBs against KBs of weights): two devices that each hold about
    # half of the 152 KB fp32 transformer
    placement = PlacementSpec("0=100KB,1=100KB", overhead="0=0,1=0", dtype="float32")
    plan = make_plan(str(folder), PlanOptions(placement, generation=Generation(height=0, width=0, num_frames=FRAMES),
                                              component="transformer"))
    return plan.to_json()["components"]["transformer"]["device_map"]


def test_the_planner_splits_the_transformer_between_blocks_with_norm_out_hooked_beside_the_root(folder, oracle,
                                                                                                  tmp_path):
    device_map = planned_transformer_map(folder)
    assert set(device_map.values()) == {0, 1}, device_map
    # the tiny twin's embedders outweigh its blocks, so the cut falls before them: the last block's output comes
    # back through norm_out's hook to the root's tensors (a 2 x 24 GB plan of ltx-2 cuts between its 48 blocks:
    # scripts/bench_plan.py case 40)
    assert device_map["transformer_blocks.1"] != device_map["scale_shift_table"], device_map
    assert device_map["norm_out"] == device_map["audio_norm_out"] == device_map["scale_shift_table"], device_map
    assert device_map["time_embed.linear"] == device_map["scale_shift_table"]

    plan_path = hand_plan(folder, tmp_path)
    plan = json.loads(open(plan_path).read())
    plan["components"]["transformer"]["device_map"] = device_map
    open(plan_path, "w").write(json.dumps(plan))
    frames, audio, rate = oracle
    result = _run(folder, tmp_path / "out", device_map=plan_path, simulate=True)
    assert result.split_check and result.split_problems == [], result.split_problems
    from PIL import Image

    from dm_cli.io.video import AUDIO_NAME, read_wav

    got = np.stack([np.array(Image.open(p)) for p in sorted((tmp_path / "out").glob("frame-*.png"))])
    assert np.array_equal(got, frames)
    wave, got_rate = read_wav(tmp_path / "out" / AUDIO_NAME)
    assert got_rate == rate and np.array_equal(wave, audio)


def test_without_the_norm_out_hook_the_same_cut_fails_the_split_check(folder):
    from test_plan_execute import inputs_for

    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.trace.trace import check_device_map

    device_map = {k: v for k, v in planned_transformer_map(folder).items() if not k.endswith("norm_out")}
    source = resolve_source(str(folder))
    comp = source.component("transformer")

    problems = check_device_map(comp, source.pipeline_class, inputs_for(source.pipeline_class), "float32", device_map)
    assert any("combines tensors on devices" in p for p in problems), problems
