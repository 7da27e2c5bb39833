"""`dmap run --json` and the queue's `--json` write `stages` in one shape (issue 56, item 7; docs/CONTRACTS.md)."""

from types import SimpleNamespace

from dm_cli.families import Job
from dm_cli.inputs import Generation
from dm_cli.run.loops.carry import RESULT_JSON_VERSION, StageResult, stages_json
from dm_cli.run.sessions.queue_runner import QueueResult
from dm_cli.run.sessions.single import RunResult


def _run_json() -> dict:
    stages = [StageResult("encode", ["text_encoder"], load_s=0.5, run_s=0.1),
              StageResult("denoise", ["transformer"], load_s=1.0, run_s=2.0)]
    return RunResult(source="demo", pipeline_class="FluxPipeline", demo=True, plan=SimpleNamespace(mode="staged"),
                     plan_digest="0" * 16, planned_here=True, simulate=False,
                     job=Job.of(Generation(steps=2, guidance_scale=3.5, height=32, width=32, num_images=1), "", 0),
                     images=[], latents_path=None, stages=stages).to_json()


def _queue_json() -> dict:
    result = QueueResult("out", 0, 1, 2, 2)
    result.stages = {"encode": {"loads": 1, "load_s": 0.5, "run_s": 0.1, "components": ["text_encoder"]},
                     "denoise": {"loads": 1, "load_s": 1.0, "run_s": 2.0, "components": ["transformer"]}}
    return result.to_json()


def test_run_and_queue_json_share_the_stages_shape_and_version():
    run, queue = _run_json(), _queue_json()
    assert run["version"] == queue["version"] == RESULT_JSON_VERSION == 2
    for document in (run, queue):
        assert isinstance(document["stages"], list)
        assert [s["name"] for s in document["stages"]] == ["encode", "denoise"]
        assert all(next(iter(s)) == "name" for s in document["stages"])  # the name first, in both
    shared = {"name", "components", "load_s", "run_s"}  # what both paths measure, with the same types
    for ran, queued in zip(run["stages"], queue["stages"]):
        assert shared <= set(ran) and shared <= set(queued)
        assert {k: type(ran[k]) for k in shared} == {k: type(queued[k]) for k in shared}
        assert {k: ran[k] for k in shared} == {k: queued[k] for k in shared}


def test_stages_json_takes_dataclasses_and_mappings_alike():
    stage = StageResult("decode", ["vae"], run_s=0.25)
    as_dict = {"name": "decode", **{k: v for k, v in stages_json([stage])[0].items() if k != "name"}}
    assert stages_json([stage]) == stages_json([as_dict])
