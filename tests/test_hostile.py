"""Hostile input, written as attacks: the input, the command, the exit code, the message and what
is on disk afterwards. Numbers in the test names follow the items of the hostile-input review:
1 writes outside the output, 2 --in-place kills, 3 output races, 5 terminal escapes, 6 bad input
that must be exit 2, 7 `dmap run` outputs checked first, 8 the Hub cache. Item 4 (headers) is in
test_hostile_headers.py.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import REPO
from dm_cli import shard as shard_module
from dm_cli import swap as swap_module


# --- helpers ----------------------------------------------------------------------------------------


def cli(capsys, *args) -> tuple[int, str, str]:
    """The real entry point, in-process: exit code, stdout, stderr."""
    from dm_cli.cli import main

    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def tree(root: Path) -> dict:
    """Every file and folder under root (hidden ones included) with a digest of each file."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[rel] = "dir"
    return found


def weights(seed: int = 0, count: int = 6) -> dict:
    rng = np.random.default_rng(seed)
    return {f"blocks.{i}.weight": rng.standard_normal((8, 16 + i)).astype(np.float32) for i in range(count)}


def component(folder: Path, seed: int = 0, cls: str = "UNet2DConditionModel") -> dict:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": cls}))
    state = weights(seed)
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    return state


def pipeline(root: Path, names: dict) -> None:
    """A pipeline folder whose model_index.json lists `names` (key -> [library, class])."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline", **names}))


def loaded(folder: Path) -> dict:
    """The tensors a loader sees in a component folder (one file or an index and its shards)."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    files = sorted({folder / n for n in json.loads(index.read_text())["weight_map"].values()}) if index.exists() \
        else [folder / "diffusion_pytorch_model.safetensors"]
    state = {}
    for path in files:
        state.update(load_file(str(path)))
    return state


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# --- 1. component names that escape the source or the output ----------------------------------------


@pytest.mark.parametrize("key", ["../victim", "../../etc", "ABSOLUTE", "unet/../../victim", "a/b", "..", "."])
def test_1_component_key_that_is_a_path_is_refused(tmp_path, capsys, key):
    """model_index.json {"../victim": [...]}: `dmap shard PIPE -s 0 -o OUT` would read PIPE/../victim and
    write OUT/../victim, i.e. into the victim folder itself. Refused, exit 2, nothing written anywhere."""
    victim = tmp_path / "victim"
    component(victim)
    if key == "ABSOLUTE":
        key = str(victim)
    pipeline(tmp_path / "pipe", {key: ["diffusers", "UNet2DConditionModel"]})
    component(tmp_path / "pipe" / "unet", seed=1)
    before = tree(tmp_path)
    for command in (["shard", tmp_path / "pipe", "-s", "0", "-o", tmp_path / "out"],
                    ["inspect", tmp_path / "pipe"], ["plan", tmp_path / "pipe", "-m", "cpu=1GB"]):
        code, out, err = cli(capsys, *command)
        assert code == 2, (command, out, err)
        assert "not a plain folder name" in err and repr(key) in err, err
    assert tree(tmp_path) == before  # no OUT, nothing beside or inside the victim, no temp folders


def test_1_plain_component_names_still_work(tmp_path, capsys):
    state = component(tmp_path / "pipe" / "unet")
    pipeline(tmp_path / "pipe", {"unet": ["diffusers", "UNet2DConditionModel"], "scheduler": [None, None]})
    code, out, err = cli(capsys, "shard", tmp_path / "pipe", "-s", "0", "-o", tmp_path / "out")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "pipe"]
    assert_same_state(loaded(tmp_path / "out" / "unet"), state)


# --- 2. --in-place killed at every rename -------------------------------------------------------------

KILL_AT_RENAME = """
import os, sys
from dm_cli import swap
kill_at = int(sys.argv[1])
count = [0]
real = swap._rename
def rename(src, dst, flags=0):
    if count[0] == kill_at:
        os._exit(137)  # SIGKILL-like: no cleanup, no finally blocks
    count[0] += 1
    return real(src, dst, flags)
swap._rename = rename
if sys.argv[2] == "no-renameat2":
    swap._renameat2 = lambda src, dst, flags: False
from dm_cli.shard import shard
kwargs = dict(in_place=True) if sys.argv[3] == "in-place" else dict(output=sys.argv[4], overwrite=True)
shard(sys.argv[5], 1500, min_shard_size=1, **kwargs)
print("renames", count[0])
"""


def _run_killed(kill_at: int, renameat2: str, mode: str, out: Path, source: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILL_AT_RENAME, str(kill_at), renameat2, mode, str(out), str(source)],
                          capture_output=True, text=True, cwd=REPO)


def test_2_in_place_killed_at_every_rename_loses_nothing(tmp_path):
    """`dmap shard SRC -s 1500 --in-place` (3 shards + index from one file), killed between any two renames of the swap: at that instant
    the source is untouched or a committed swap folder holds everything; the next run finishes the
    swap, and the result loads bit-identical, with no backup left behind."""
    template = tmp_path / "template"
    state = component(template)
    full = _run_killed(10**6, "yes", "in-place", tmp_path / "unused", _copy(template, tmp_path / "count"))
    assert full.returncode == 0, full.stderr
    renames = int(full.stdout.split()[-1])
    assert renames >= 6  # commit, old file aside, shards and index in, discard
    for kill_at in range(renames):
        work = tmp_path / f"k{kill_at}"
        work.mkdir()
        src = _copy(template, work / "src")
        before = tree(src)
        killed = _run_killed(kill_at, "yes", "in-place", work / "unused", src)
        assert killed.returncode == 137, killed.stderr
        swaps = [p for p in work.iterdir() if ".dmap-swap-" in p.name]
        if not swaps:
            assert tree(src) == before, kill_at  # not committed yet: the source was never touched
        else:
            assert (swaps[0] / "dmap-swap.json").is_file()  # committed: the journal says how to finish
        result = shard_module.shard(str(src), 1500, in_place=True, min_shard_size=1)
        if swaps:
            assert any("Finished an interrupted --in-place swap" in done for done in result.removed_stale)
        assert_same_state(loaded(src), state)
        assert sorted(p.name for p in work.iterdir()) == ["src"], kill_at  # no backup, no temp left
        assert (src / "diffusion_pytorch_model.safetensors.index.json").is_file()
        assert not (src / "diffusion_pytorch_model.safetensors").exists()


def test_2_in_place_failure_mid_swap_names_the_backup(tmp_path, monkeypatch, capsys):
    """A rename that fails (not a kill) in the middle of the swap: exit 2, the message says where the
    old weights are and that rerunning finishes; rerunning does."""
    state = component(tmp_path / "src")
    real, calls = swap_module._rename, {"n": 0}

    def failing(src, dst, flags=0):
        calls["n"] += 1
        if calls["n"] == 3:  # after the commit and moving the old file aside
            raise PermissionError(13, "Permission denied")
        return real(src, dst, flags)

    monkeypatch.setattr(swap_module, "_rename", failing)
    code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "--in-place")
    assert code == 2 and "old ones are kept in" in err and "again to finish" in err, err
    swap = next(p for p in tmp_path.iterdir() if ".dmap-swap-" in p.name)
    assert str(swap) in err
    monkeypatch.setattr(swap_module, "_rename", real)
    monkeypatch.setattr(swap_module, "_pid_alive", lambda pid: False)  # as in a later process
    code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "--in-place")
    assert code == 0, err
    assert "Finished an interrupted --in-place swap" in out
    assert_same_state(loaded(tmp_path / "src"), state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_2_in_place_never_overwrites_a_file_it_does_not_replace(tmp_path):
    """A new shard name is taken by a user file that is not part of the weights: refused up front."""
    from dm_cli.errors import UsageError

    component(tmp_path / "src")
    (tmp_path / "src" / "diffusion_pytorch_model-00001-of-00004.safetensors").write_text("my notes")
    before = tree(tmp_path)
    with pytest.raises(UsageError, match="not one of the files being replaced") as error:
        shard_module.shard(str(tmp_path / "src"), 1500, in_place=True, min_shard_size=1)
    assert error.value.exit_code == 2
    assert tree(tmp_path) == before


@pytest.mark.parametrize("renameat2", ["yes", "no-renameat2"])
def test_2_overwrite_killed_at_every_rename_keeps_an_output(tmp_path, renameat2):
    """`dmap shard SRC -o OUT --overwrite` killed at each rename: OUT is the old or the new output, or
    (without RENAME_EXCHANGE, between its two renames) restored by the next run."""
    template = tmp_path / "template"
    state = component(template)
    full = _run_killed(10**6, renameat2, "overwrite", tmp_path / "count-out", template)
    assert full.returncode == 0, full.stderr
    for kill_at in range(int(full.stdout.split()[-1])):
        work = tmp_path / f"{renameat2}-{kill_at}"
        out = work / "out"
        out.mkdir(parents=True)
        (out / "old.txt").write_text("the old output")
        killed = _run_killed(kill_at, renameat2, "overwrite", out, template)
        assert killed.returncode == 137, killed.stderr
        shard_module.shard(str(template), 1500, output=out, overwrite=True, min_shard_size=1)
        assert_same_state(loaded(out), state)
        assert sorted(p.name for p in work.iterdir()) == ["out"]


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# --- 3. the output name is claimed atomically ----------------------------------------------------------


@pytest.mark.parametrize("renameat2", [True, False])
def test_3_folder_created_at_output_during_the_run_is_kept(tmp_path, monkeypatch, capsys, renameat2):
    """While `dmap shard SRC -o OUT` writes, the user creates OUT with a file. Without --overwrite the
    run ends in exit 2 and OUT with the user's file is untouched."""
    component(tmp_path / "src")
    if not renameat2:
        monkeypatch.setattr(swap_module, "_renameat2", lambda src, dst, flags: False)
    real = shard_module._fsync_tree

    def user_creates_out(root):
        real(root)
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "mine.txt").write_text("do not delete")

    monkeypatch.setattr(shard_module, "_fsync_tree", user_creates_out)
    code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "-o", tmp_path / "out")
    assert code == 2 and "appeared while dmap was writing it" in err, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # our temp folder is gone


@pytest.mark.parametrize("renameat2", [True, False])
def test_3_two_runs_to_the_same_output_never_lose_one_silently(tmp_path, monkeypatch, capsys, renameat2):
    """Two `dmap shard SRC -o OUT` at once: the second to finish exits 2 and the first one's result stays."""
    first = component(tmp_path / "a")
    component(tmp_path / "b", seed=7)
    if not renameat2:
        monkeypatch.setattr(swap_module, "_renameat2", lambda src, dst, flags: False)
    real = shard_module._fsync_tree
    nested = []

    def other_run_finishes_first(root):
        real(root)
        if not nested:
            nested.append(None)
            nested[0] = cli(capsys, "shard", tmp_path / "a", "-s", "0", "-o", tmp_path / "out")

    monkeypatch.setattr(shard_module, "_fsync_tree", other_run_finishes_first)
    code, out, err = cli(capsys, "shard", tmp_path / "b", "-s", "0", "-o", tmp_path / "out")
    assert nested[0][0] == 0, nested
    assert code == 2 and "appeared while dmap was writing it" in err, err
    assert_same_state(loaded(tmp_path / "out"), first)
    assert hidden(tmp_path) == []


def test_3_missing_or_read_only_output_parent_is_exit_2(tmp_path, capsys):
    component(tmp_path / "src")
    code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "-o", tmp_path / "no" / "such" / "out")
    assert code == 2 and "does not exist" in err, err
    assert not (tmp_path / "no").exists()
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o555)
        code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "-o", tmp_path / "ro" / "out")
        assert code == 2 and "permission denied" in err, err


# --- 8. the Hugging Face cache is read-only to dmap ---------------------------------------------------


def _hub(tmp_path: Path) -> tuple[Path, Path]:
    cache = tmp_path / "hub"
    repo = cache / "models--acme--model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    component(snapshot / "unet")
    pipeline(snapshot, {"unet": ["diffusers", "UNet2DConditionModel"]})
    component(repo / "snapshots" / "secret")  # beside the snapshot: never reachable by a repo path
    return cache, snapshot


def test_8_shard_of_a_hub_repo_never_writes_into_the_cache(tmp_path, monkeypatch, capsys):
    cache, snapshot = _hub(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    before = tree(cache)
    code, out, err = cli(capsys, "shard", "acme/model", "-s", "0")  # the default output was inside the cache
    assert code == 2 and "never writes into" in err and "--output" in err, err
    code, out, err = cli(capsys, "shard", "acme/model", "-s", "0", "-o", snapshot / "unet-sharded")
    assert code == 2 and "inside the Hugging Face cache" in err, err
    code, out, err = cli(capsys, "shard", "acme/model/unet", "-s", "0", "--in-place")
    assert code == 2 and "will not modify" in err, err
    assert tree(cache) == before
    code, out, err = cli(capsys, "shard", "acme/model", "-s", "0", "-o", tmp_path / "mine")
    assert code == 0, err
    assert tree(cache) == before and (tmp_path / "mine" / "unet" / "diffusion_pytorch_model.safetensors").is_file()


@pytest.mark.parametrize("spec", ["acme/model/..", "acme/model/.", "acme/../model", "acme/model/../secret"])
def test_8_repo_paths_stay_inside_their_snapshot(tmp_path, monkeypatch, capsys, spec):
    cache, _ = _hub(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "inspect", spec)
    assert code == 2, (out, err)
    assert "secret" not in out
