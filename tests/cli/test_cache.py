"""Cache keys name what produced an entry: a changed dmap rebuilds instead of reading a stale entry."""

import shutil

import pytest

import dm_cli
from dm_cli.io import cache
from dm_cli.model.sources import resolve_source


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """A copy of dm_cli's code that the cache takes as the producer, to be edited by the test."""
    copy = tmp_path / "dm_cli"
    shutil.copytree(cache.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "presets"))
    monkeypatch.setattr(cache, "PACKAGE_DIR", copy)
    cache.code_digest.cache_clear()
    yield copy
    cache.code_digest.cache_clear()


def edit(path):
    path.write_text(path.read_text() + "\n# edited\n")
    cache.code_digest.cache_clear()


def test_key_changes_with_the_computing_code_and_the_version(package_copy, monkeypatch):
    parts = {"config": {"a": 1}}
    first = cache.cache_key(parts)
    assert cache.cache_key(parts) == first
    edit(package_copy / "render" / "plan.py")  # talks to people only: not a producer
    assert cache.cache_key(parts) == first
    edit(package_copy / "planning" / "trace" / "trace.py")
    second = cache.cache_key(parts)
    assert second != first
    (package_copy / "new_module.py").write_text("X = 1\n")  # code moved to a new module counts too
    cache.code_digest.cache_clear()
    assert cache.cache_key(parts) != second
    monkeypatch.setattr(dm_cli.version, "__version__", "99.0")
    assert cache.cache_key(parts) not in (first, second)


def test_a_changed_producer_rebuilds_skeletons_and_traces(package_copy, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from dm_cli.inputs import InputSpec
    from dm_cli.model import skeleton
    from dm_cli.planning.trace import trace

    monkeypatch.setenv("DMAP_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve_source("tiny-sd15")
    vae = source.component("vae")
    built = []
    real_build = skeleton.skeleton_from_model
    monkeypatch.setattr(skeleton, "skeleton_from_model", lambda *a: built.append(a[0]) or real_build(*a))

    def both():
        skel = skeleton.load_skeleton("vae", vae.library, vae.cls, vae.config)
        traced = trace.trace_component(vae, source.pipeline_class, InputSpec(64, 64), "fp32")
        return skel, traced

    first_skeleton, first_trace = both()
    assert built == ["vae"] and first_trace.seconds > 0
    again_skeleton, again_trace = both()
    assert built == ["vae"] and again_trace.seconds == 0.0  # read from the cache
    edit(package_copy / "model" / "skeleton.py")
    rebuilt_skeleton, rebuilt_trace = both()
    assert built == ["vae", "vae"] and rebuilt_trace.seconds > 0
    assert rebuilt_skeleton.to_json() == first_skeleton.to_json()
    assert rebuilt_trace.execution_order == first_trace.execution_order
    for kind in ("skeletons", "traces"):
        assert len(list((tmp_path / "cache" / kind).glob("*.json"))) == 2, kind


def test_a_damaged_demo_pipeline_is_generated_again(tmp_path, monkeypatch):
    """The demo lives in dmap's cache: a truncated shard or a config that is not an object is rebuilt, never an
    error (nor advice to re-download what dmap generates itself)."""
    from dm_cli.model.demo import ensure_demo

    monkeypatch.setenv("DMAP_CACHE_DIR", str(tmp_path))
    folder = ensure_demo()
    shard = sorted((folder / "transformer").glob("*.safetensors"))[0]
    intact = shard.read_bytes()
    shard.write_bytes(intact[:-100])
    assert ensure_demo() == folder and shard.read_bytes() == intact  # the same seed: the same weights
    (folder / "text_encoder" / "config.json").write_text("[1]")
    assert ensure_demo() == folder and resolve_source(str(folder)).component("text_encoder").config.get("architectures")
