"""Small edges of the specs (issue 44, H): an empty `--cache` is refused (it used to mean no cache, silently),
`none` takes no settings (it used to be "unknown cache 'none'"), and a SOURCE that is a symlink loop says so (it
used to be "nothing is there"). Each is exit 2, one sentence."""

import json
import os

import pytest
from conftest import run_dmap

from dm_cli.errors import UsageError

TINY = "tiny-flux"  # a preset: plans without weights


def _refused(*args) -> str:
    code, _, err = run_dmap(*args)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("spec,words", [
    ("", "--cache is empty"), ("  ", "--cache is empty"), (":threshold=0.1", "--cache is empty"),
    ("none:threshold=1", "none takes no settings"), ("none:", "none takes no settings"),
])
def test_an_empty_cache_or_none_with_settings_is_refused(spec, words):
    err = _refused("plan", TINY, "--max-memory", "cpu=8GB", "--cache", spec)
    assert words in err, err


def test_the_api_and_a_queue_item_refuse_them_too(tmp_path):
    from dm_cli.planning.step_cache import parse_cache

    assert parse_cache("none") is None and parse_cache(None) is None
    with pytest.raises(UsageError, match="is empty"):
        parse_cache({"name": ""})
    with pytest.raises(UsageError, match="none takes no settings"):
        parse_cache({"name": "none", "threshold": 1})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a fox", "cache": ""}) + "\n")
    err = _refused("run", "--prompts", prompts, "-o", tmp_path / "out")
    assert "'cache' is empty" in err, err


def test_a_symlink_loop_as_source_is_called_a_loop(tmp_path):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    for source in (tmp_path / "a", tmp_path / "a" / "model_index.json"):
        for command in (("plan", source, "--max-memory", "cpu=8GB"), ("inspect", source),
                        ("run", source, "-p", "a fox", "-o", tmp_path / "x.png")):
            err = _refused(*command)
            assert "symlink loop" in err and str(source) in err, err
    assert not (tmp_path / "x.png").exists()


def test_a_dangling_symlink_as_source_names_its_target(tmp_path):
    os.symlink(tmp_path / "gone", tmp_path / "link")
    err = _refused("plan", tmp_path / "link", "--max-memory", "cpu=8GB")
    assert "is a symlink to" in err and "gone" in err and "does not exist" in err, err
