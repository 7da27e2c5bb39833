"""Strict JSON everywhere dmap writes it (issue 57, item 2): every command's `--json`, the plan file, the queue's
manifest, the calibrated profile and served answers parse with a parser that refuses NaN and Infinity (Python's json
writes them; no other parser reads them). dmap writes through one writer (`dm_cli.io.strict_json.json_text`), which
refuses a non-finite number loudly: a bug, exit 1, never a file or a document carrying it."""

import json
import math

import pytest
from conftest import run_dmap

from dm_cli.io.strict_json import NonFiniteNumber, json_text, non_finite_path

WIDE = {"COLUMNS": "1000"}


def strict_json(text: str):
    """json.loads refusing NaN and Infinity, as a strict parser (JavaScript's, Go's, jq's) does."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def _strict_lines(text: str) -> list:
    return [strict_json(line) for line in text.splitlines() if line.strip()]


def _finite(value) -> bool:
    return non_finite_path(value) is None and all(
        math.isfinite(v) for v in _numbers(value))


def _numbers(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, float):
        yield value


def _json_of(*args) -> dict:
    code, out, err = run_dmap(*args, "--json", env=WIDE)
    assert code == 0, (args, err)
    document = strict_json(out)
    assert _finite(document), args
    return document


def test_inspect_plan_and_cache_json_is_strict(tmp_path):
    _json_of("inspect", "tiny-flux")
    _json_of("inspect", "demo")
    plan_file = tmp_path / "plan.json"
    plan = _json_of("plan", "tiny-flux", "-m", "0=16GB", "--profile", "table:l40s", "--steps", "7", "-o", plan_file)
    assert plan["predicted_time"]["step_s"] > 0
    assert strict_json(plan_file.read_text()) == plan
    _json_of("plan", "demo", "-m", "0=16GB,cpu=32GB")
    _json_of("cache")


def test_calibrate_json_and_its_profile_are_strict(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "cpu.json"
    document = _json_of("calibrate", "--quick", "--device", "cpu", "-o", path)
    assert document["path"] == str(path) and strict_json(path.read_text()) == document["profile"]
    assert set(document["load"]) == {"load_average", "cores", "spread", "busy"}


def test_run_queue_and_shard_json_are_strict(tmp_path):
    pytest.importorskip("torch")
    size = ("--steps", "1", "--height", "64", "--width", "64")
    _json_of("run", "demo", "--prompt", "a fox", *size, "-o", tmp_path / "fox.png")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\na red boat\n")
    queue = tmp_path / "queue"
    _json_of("run", "demo", "--prompts", prompts, *size, "-o", queue)
    records = _strict_lines((queue / "manifest.jsonl").read_text())
    assert len(records) == 2 and all(_finite(r) for r in records)
    code, _, err = run_dmap("demo", "tiny-sd15", "-o", tmp_path / "pipeline", env=WIDE)
    assert code == 0, err
    _json_of("shard", tmp_path / "pipeline" / "unet", "-o", tmp_path / "unet-sharded", "--max-shard-size", "0")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_writer_refuses_a_non_finite_number_naming_where(bad):
    with pytest.raises(NonFiniteNumber, match=r"\$\.predicted_time\.layouts\[1\]"):
        json_text({"predicted_time": {"step_s": 1.0, "layouts": [0.5, bad]}}, indent=2)
    assert json_text({"a": [1.5, None, "x"]}) == '{"a": [1.5, null, "x"]}'


def test_json_on_stdout_with_a_non_finite_number_is_a_loud_bug_not_a_document(monkeypatch):
    from dm_cli.planning.plan_file import Plan

    real = Plan.to_json

    def broken(self):
        return {**real(self), "predicted_time": {"step_s": float("inf")}}
    monkeypatch.setattr(Plan, "to_json", broken)
    code, out, err = run_dmap("plan", "tiny-flux", "-m", "cpu=8GB", "--json", env=WIDE)
    assert code == 1 and out == "", (code, out)
    assert "non-finite number (inf) at $.predicted_time.step_s" in err and "report it" in err, err


def test_a_served_answer_goes_through_the_same_writer():
    pytest.importorskip("starlette")
    from dm_cli.serve.app import json_response

    response = json_response({"seconds": 0.25, "text": "é"}, status_code=201)
    assert response.status_code == 201 and response.media_type == "application/json"
    assert strict_json(response.body.decode("utf-8")) == {"seconds": 0.25, "text": "é"}
    with pytest.raises(NonFiniteNumber):
        json_response({"seconds": float("nan")})
