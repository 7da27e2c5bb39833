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
from conftest import REPO
from safetensors.numpy import load_file, save_file

from dm_cli.io import swap as swap_module
from dm_cli.model import shard as shard_module

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
from dm_cli.io import swap
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
from dm_cli.model.shard import shard
kwargs = dict(in_place=True) if sys.argv[3] == "in-place" else dict(output=sys.argv[4], overwrite=True)
shard(sys.argv[5], 1500, min_shard_size=1, **kwargs)
print("renames", count[0])
"""


def _run_killed(kill_at: int, renameat2: str, mode: str, out: Path, source: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILL_AT_RENAME, str(kill_at), renameat2, mode, str(out), str(source)],
                          capture_output=True, text=True, cwd=REPO)


def test_2_in_place_killed_at_every_rename_loses_nothing(tmp_path, capsys):
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
            code, out, err = cli(capsys, "inspect", src)  # any other command says where everything is
            assert code == 2 and "half-swapped" in err and str(swaps[0]) in err, err
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


def test_2_backup_left_by_an_older_dmap_is_never_removed(tmp_path):
    """A `.src.dmap-old-PID-*` folder (the old design's --in-place backup) may hold the only copy of
    the weights: later runs leave it alone and point at it."""
    state = component(tmp_path / "src")
    legacy = tmp_path / ".src.dmap-old-999999999-abcd"
    component(legacy, seed=3)
    before = tree(legacy)
    result = shard_module.shard(str(tmp_path / "src"), 1500, in_place=True, min_shard_size=1)
    assert any(str(legacy) in done and "remove the folder yourself" in done for done in result.removed_stale)
    assert tree(legacy) == before
    assert_same_state(loaded(tmp_path / "src"), state)


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
    counted = tmp_path / "count-out"  # an existing output, as below: replacing it takes every rename
    counted.mkdir()
    (counted / "config.json").write_text("{}")  # an old output: a folder dmap could have written
    full = _run_killed(10**6, renameat2, "overwrite", counted, template)
    assert full.returncode == 0, full.stderr
    restored = []
    for kill_at in range(int(full.stdout.split()[-1])):
        work = tmp_path / f"{renameat2}-{kill_at}"
        out = work / "out"
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        killed = _run_killed(kill_at, renameat2, "overwrite", out, template)
        assert killed.returncode == 137, killed.stderr
        if not out.exists():  # killed between moving the old output aside and putting the new one in place
            restored.append(kill_at)
        result = shard_module.shard(str(template), 1500, output=out, overwrite=True, min_shard_size=1)
        assert bool(restored and restored[-1] == kill_at) == any("Restored" in line for line in result.removed_stale)
        assert_same_state(loaded(out), state)
        assert sorted(p.name for p in work.iterdir()) == ["out"]
    assert bool(restored) == (renameat2 != "yes")  # only without RENAME_EXCHANGE is there such a moment


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
    """Two `dmap shard SRC -o OUT` at once: the second is refused at its start by the first's claim (issue 44 D);
    another writer that does not claim (the API, another program) finishing first: the one still writing exits 2
    and the first one's result stays."""
    first = component(tmp_path / "a")
    component(tmp_path / "b", seed=7)
    if not renameat2:
        monkeypatch.setattr(swap_module, "_renameat2", lambda src, dst, flags: False)
    real = shard_module._fsync_tree
    nested = []

    def other_run_finishes_first(root):
        real(root)
        if not nested:
            nested.append(cli(capsys, "shard", tmp_path / "a", "-s", "0", "-o", tmp_path / "out"))
            nested.append(shard_module.shard(str(tmp_path / "a"), 0, output=tmp_path / "out"))

    monkeypatch.setattr(shard_module, "_fsync_tree", other_run_finishes_first)
    code, out, err = cli(capsys, "shard", tmp_path / "b", "-s", "0", "-o", tmp_path / "out")
    assert nested[0][0] == 2 and "is being written by another dmap shard (pid " in nested[0][2], nested
    assert code == 2 and "appeared while dmap was writing it" in err, err
    assert_same_state(loaded(tmp_path / "out"), first)
    assert hidden(tmp_path) == []


def test_3_missing_or_read_only_output_parent_is_exit_2(tmp_path, capsys, monkeypatch):
    component(tmp_path / "src")
    code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "-o", tmp_path / "no" / "such" / "out")
    assert code == 2 and "does not exist" in err, err
    assert not (tmp_path / "no").exists()
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere: the kernel's answer for any other user, asked of os.access
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: (Path(path) != read_only or not mode & os.W_OK)
                            and real(path, mode, **kw))
    code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "-o", read_only / "out")
    assert code == 2 and "permission denied" in err, err
    assert list(read_only.iterdir()) == []


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


# --- 5. names from files never reach the terminal raw ----------------------------------------------

EVIL = ["\x1b]0;pwned\x07", "\x1b[2J", "[/oops]", "[bold red]x[/]", "a\u202eb", "\x9b31m"]


def test_5_tensor_names_with_escapes_and_markup_are_shown_inert(tmp_path, capsys):
    """A .safetensors whose tensor names hold an OSC title-set, a clear-screen, C1 CSI, a bidi override
    and Rich markup: `dmap inspect FILE --depth 3` and `dmap shard` print them escaped, exit 0."""
    state = {f"{name}.weight": np.ones((2, 3), np.float32) for name in EVIL}
    save_file(state, str(tmp_path / "evil.safetensors"))
    code, out, err = cli(capsys, "inspect", tmp_path / "evil.safetensors", "--depth", "3")
    assert code == 0, err
    for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert raw not in out + err
    assert "\\x1b]0;pwned\\x07" in out and "\\x1b[2J" in out and "[/oops]" in out and "[bold red]x[/]" in out
    code, out, err = cli(capsys, "shard", tmp_path / "evil.safetensors", "-s", "0", "-o", tmp_path / "out")
    assert code == 0 and "\x1b" not in out + err, err


def test_5_escapes_in_error_messages_are_shown_inert(tmp_path, capsys):
    """A config class name with escapes, and an index naming tensors with escapes: exit 2, no raw escape."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps({"_class_name": "\x1b]0;pwned\x07[/oops]"}))
    code, out, err = cli(capsys, "inspect", tmp_path / "c")
    assert code == 2 and "\x1b" not in err and "\x07" not in err and "not a class name" in err, err
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "m-00001-of-00001.safetensors"))
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "m-00001-of-00001.safetensors", "\x1b[2J[/oops]": "m-00001-of-00001.safetensors"}}))
    code, out, err = cli(capsys, "inspect", tmp_path / "m.safetensors.index.json")
    assert code == 2 and "\x1b" not in out + err and "\\x1b[2J[/oops]" in err, err


def test_5_plan_file_names_are_rendered_inert(capsys):
    """A plan file (read by `dmap run -d`) is input too: its component, class and module names are shown inert."""
    from dm_cli.planning.plan_file import Plan
    from dm_cli.render.plan import render_plan

    plan = _plan_document()
    plan["components"]["\x1b[2Jvae"] = plan["components"].pop("vae")
    plan["components"]["\x1b[2Jvae"]["class"] = "[/oops]\x1b]0;t\x07"
    plan["components"]["\x1b[2Jvae"]["device_map"] = {"down": 0, "up": 1}  # a key that is no module name: exit 2
    plan["stages"][0]["components"] = ["\x1b[2Jvae"]
    plan["warnings"] = ["[/oops] \x1b[2J"]
    render_plan(Plan.from_json(plan))
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "[/oops]" in out and "\\x1b[2J" in out


# --- 6. bad input is exit 2 with one sentence, never exit 1 -----------------------------------------


def _plan_document() -> dict:
    return {
        "format": "dmap-plan", "version": 1, "source": "x", "dtype": "float32", "strategy": "auto", "mode": "staged",
        "devices": {"0": {"capacity_bytes": 10**9}, "1": {"capacity_bytes": 10**9}, "cpu": {"capacity_bytes": 10**10}},
        "inputs": {"height": 64, "width": 64, "batch_size": 1},
        "components": {"vae": {"class": "AutoencoderKL", "weights_bytes": 100, "device_map": {"": 0}}},
        "stages": [{"name": "decode", "components": ["vae"], "peak_bytes": {"0": 100}}],
    }


def _set(document: dict, path: tuple, value) -> dict:
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return document


PLAN_ATTACKS = {
    "a list": ([], "must be a JSON object"),
    "a number": (5, "must be a JSON object"),
    "devices a list": (("devices",), [], "'devices' must be a JSON object"),
    "device evil": (("components", "vae", "device_map", ""), "evil", "not a device: 'evil'"),
    "device null": (("components", "vae", "device_map", ""), None, "not a device: None"),
    "device [1]": (("components", "vae", "device_map", ""), [1], "not a device: [1]"),
    "device -1": (("components", "vae", "device_map", ""), -1, "not a device: -1"),
    "device true": (("components", "vae", "device_map", ""), True, "not a device: True"),
    "device key evil": (("devices", "evil"), {"capacity_bytes": 1}, "not a device: 'evil'"),
    "capacity a string": (("devices", "0", "capacity_bytes"), "16GB", "capacity_bytes must be a whole number"),
    "capacity negative": (("devices", "0", "capacity_bytes"), -5, "capacity_bytes must be a whole number"),
    "component a list": (("components", "vae"), [], "must be a JSON object"),
    "device_map a list": (("components", "vae", "device_map"), [0], "device_map must be a JSON object"),
    "unknown stage component": (("stages", 0, "components"), ["unet"], "names component 'unet'"),
    "stage a number": (("stages", 0), 5, "a stage must be a JSON object"),
    "stages empty": (("stages",), [], "non-empty list"),
    "inputs a list": (("inputs",), [64], "'inputs' must be a JSON object"),
    "inputs height a string": (("inputs", "height"), "64", "--height must be a whole number"),
    "peak_bytes a list": (("stages", 0, "peak_bytes"), [1], "peak_bytes must be a JSON object"),
}


@pytest.mark.parametrize("case", sorted(PLAN_ATTACKS))
def test_6_plan_file_of_the_wrong_shape_is_exit_2_before_loading(tmp_path, monkeypatch, capsys, case):
    """`dmap run -p x -d plan.json` with a damaged plan: exit 2 naming the problem, before any loading."""
    attack = PLAN_ATTACKS[case]
    document = attack[0] if len(attack) == 2 else _set(_plan_document(), *attack[:2])
    (tmp_path / "plan.json").write_text(json.dumps(document))
    _runner_must_not_start(monkeypatch)
    code, out, err = cli(capsys, "run", "-p", "x", "-d", tmp_path / "plan.json", "-o", tmp_path / "x.png")
    assert code == 2 and attack[-1] in err and err.count("\n") == 1, err


@pytest.mark.parametrize("where", ["dev-zero", "fifo", "folder", "nan", "huge"])
def test_6_plan_file_that_is_not_a_file_is_read_boundedly(tmp_path, monkeypatch, capsys, where):
    path = tmp_path / "plan.json"
    if where == "dev-zero":
        path = Path("/dev/zero")
    elif where == "fifo":
        os.mkfifo(path)  # opening it would block forever
    elif where == "folder":
        path.mkdir()
    elif where == "nan":
        path.write_text(json.dumps(_plan_document()).replace('"height": 64', '"height": NaN'))
    else:
        path.write_bytes(b" " * (65 << 20))
    _runner_must_not_start(monkeypatch)
    code, out, err = cli(capsys, "run", "-p", "x", "-d", path, "-o", tmp_path / "x.png")
    assert code == 2, err
    assert {"dev-zero": "not a regular file", "fifo": "not a regular file", "folder": "not a regular file",
            "nan": "not JSON", "huge": "more than the"}[where] in err, err


def _runner_must_not_start(monkeypatch):
    import dm_cli.run.sessions.single

    def refuse(*args, **kwargs):
        raise AssertionError("the run started: the bad input should have been caught before")

    monkeypatch.setattr(dm_cli.run.sessions.single, "run", refuse)


def _nothing_must_load(monkeypatch):
    import dm_cli.run.loops.stages

    def refuse(*args, **kwargs):
        raise AssertionError("a component loaded: the bad input should have been caught before")

    monkeypatch.setattr(dm_cli.run.loops.stages, "load_component", refuse)


@pytest.mark.parametrize("library, cls", [("diffusers", "AutoModel"), ("diffusers", "DiffusionPipeline"),
                                          ("diffusers", "ConfigMixin"), ("transformers", "AutoModel"),
                                          ("transformers", "PretrainedConfig"), ("diffusers", "ModelMixin"),
                                          ("diffusers", "NoSuchModel")])
def test_6_non_model_classes_are_exit_2(tmp_path, capsys, library, cls):
    pipeline(tmp_path / "pipe", {"unet": [library, cls]})
    (tmp_path / "pipe" / "unet").mkdir()
    (tmp_path / "pipe" / "unet" / "config.json").write_text(json.dumps({"_class_name": cls}))
    code, out, err = cli(capsys, "inspect", tmp_path / "pipe", "--no-cache")
    assert code == 2 and cls in err, err


def test_6_absurd_layer_count_is_refused_at_once(tmp_path, capsys):
    (tmp_path / "t").mkdir()
    config = json.loads((REPO / "dm_cli" / "presets" / "tiny-flux" / "transformer" / "config.json").read_text())
    (tmp_path / "t" / "config.json").write_text(json.dumps({**config, "num_layers": 1e5}))
    code, out, err = cli(capsys, "inspect", tmp_path / "t", "--no-cache")
    assert code == 2 and "num_layers=100000.0" in err and "above the 1000" in err, err


def test_6_a_config_value_the_class_rejects_is_exit_2(tmp_path, capsys):
    (tmp_path / "t").mkdir()
    config = json.loads((REPO / "dm_cli" / "presets" / "tiny-flux" / "transformer" / "config.json").read_text())
    (tmp_path / "t" / "config.json").write_text(json.dumps({**config, "num_attention_heads": "many"}))
    code, out, err = cli(capsys, "inspect", tmp_path / "t", "--no-cache")
    assert code == 2 and "Cannot build FluxTransformer2DModel from its config" in err, err


@pytest.mark.parametrize("args, words", [
    (["--guidance-scale", "nan"], "--guidance-scale must be a finite number"),
    (["--guidance-scale", "inf"], "--guidance-scale must be a finite number"),
    (["--max-memory", ""], "--max-memory is empty"),
    (["--max-memory", "0=1GB", "--overhead", ""], "needs a size"),
    (["--height", "-8"], "--height must be a whole number >= 0"),
    (["--batch-size", "0"], "--batch-size must be a whole number >= 1"),
])
def test_6_bad_plan_options_are_exit_2(capsys, args, words):
    code, out, err = cli(capsys, "plan", "tiny-sd15", *args)
    assert code == 2 and words in err, err


def test_6_unreadable_file_or_folder_in_a_pipeline_is_exit_2(tmp_path, capsys, monkeypatch):
    """As any user but root would meet them (root reads anything: os.access and the folder listing are made to
    answer as they would for another user). Nothing is written."""
    component(tmp_path / "pipe" / "unet")
    pipeline(tmp_path / "pipe", {"unet": ["diffusers", "UNet2DConditionModel"], "tokenizer": ["transformers", "CLIPTokenizer"]})
    (tmp_path / "pipe" / "tokenizer").mkdir()
    secret = tmp_path / "pipe" / "tokenizer" / "vocab.json"
    secret.write_text("{}")
    real_access, real_scandir = os.access, os.scandir
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (Path(path) != secret or not mode & os.R_OK)
                        and real_access(path, mode, **kw))
    code, out, err = cli(capsys, "shard", tmp_path / "pipe", "-s", "0", "-o", tmp_path / "out")
    assert code == 2 and "vocab.json cannot be read: permission denied" in err, err
    monkeypatch.setattr(os, "access", real_access)

    def scandir(path="."):
        if Path(path) == secret.parent:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    code, out, err = cli(capsys, "shard", tmp_path / "pipe", "-s", "0", "-o", tmp_path / "out")
    assert code == 2 and "Cannot read" in err and "tokenizer: Permission denied" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_6_dangling_symlink_in_a_pipeline_is_exit_2(tmp_path, capsys):
    component(tmp_path / "pipe" / "unet")
    pipeline(tmp_path / "pipe", {"unet": ["diffusers", "UNet2DConditionModel"], "tokenizer": ["transformers", "CLIPTokenizer"]})
    (tmp_path / "pipe" / "tokenizer").mkdir()
    (tmp_path / "pipe" / "tokenizer" / "vocab.json").symlink_to(tmp_path / "nowhere")
    code, out, err = cli(capsys, "shard", tmp_path / "pipe", "-s", "0", "-o", tmp_path / "out")
    assert code == 2 and "vocab.json" in err and "dangling" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
    (tmp_path / "pipe" / "unet" / "config.json").unlink()
    (tmp_path / "pipe" / "unet" / "config.json").symlink_to(tmp_path / "nowhere")
    code, out, err = cli(capsys, "inspect", tmp_path / "pipe")
    assert code == 2 and "config.json" in err, err


def test_6_corrupt_cache_entries_are_rebuilt(tmp_path, monkeypatch, capsys):
    """A JSON list, a number, a truncated object or wrong fields in a cache entry: rebuilt, exit 0."""
    monkeypatch.setenv("DMAP_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = cli(capsys, "inspect", "tiny-sd15", "--component", "vae", "--json")
    assert code == 0, err
    expected = json.loads(out)
    entries = sorted((tmp_path / "cache").rglob("*.json"))
    assert entries
    for damage in ("[]", "5", '{"format": "dmap-skeleton"', '{"format": "dmap-skeleton", "version": 1, "tensors": 5}'):
        for entry in entries:
            entry.write_text(damage)
        code, out, err = cli(capsys, "inspect", "tiny-sd15", "--component", "vae", "--json")
        assert code == 0, (damage, err)
        assert json.loads(out) == expected
        assert all(isinstance(json.loads(e.read_text()), dict) for e in entries)


# --- 7. `dmap run` checks its outputs before loading anything ----------------------------------------


@pytest.mark.parametrize("case", ["output is a folder", "output folder missing", "latents is a folder",
                                  "seed too large", "seed too small", "second image is a folder",
                                  "latents over the image", "output folder read-only"])
def test_7_run_outputs_are_checked_before_anything_loads(tmp_path, monkeypatch, capsys, case):
    (tmp_path / "dir").mkdir()
    (tmp_path / "out-1.png").mkdir()
    real = os.access  # root writes anywhere: "dir" answers as it would for any other user
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (Path(path) != tmp_path / "dir" or not mode & os.W_OK)
                        and real(path, mode, **kw))
    args, words = {
        "output folder read-only": (["-o", tmp_path / "dir" / "x.png"], "is not writable"),
        # an existing folder is a video's frames folder (issue 31): an image pipeline refuses it once it is known
        "output is a folder": (["-o", tmp_path / "dir"], "names a folder: image pipelines write a file"),
        "output folder missing": (["-o", tmp_path / "no" / "x.png"], "does not exist"),
        "latents is a folder": (["--save-latents", tmp_path / "dir"], "is a folder"),
        "seed too large": (["--seed", str(2**64)], "out of range"),
        "seed too small": (["--seed", str(-(2**63) - 1)], "out of range"),
        "second image is a folder": (["-o", tmp_path / "out.png", "--num-images", "2"], "out-1.png is a folder"),
        "latents over the image": (["-o", tmp_path / "x.png", "--save-latents", tmp_path / "x.png"], "give different names"),
    }[case]
    if case != "output is a folder":
        _runner_must_not_start(monkeypatch)
    else:
        _nothing_must_load(monkeypatch)
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "run", "-p", "x", *args)
    assert code == 2 and words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "out-1.png"]


@pytest.mark.parametrize("where", ["model_index.json", "unet/config.json", "vae/config.json"])
@pytest.mark.parametrize("attack", ["deep", "fifo", "nan"])
def test_6_configs_are_read_as_boundedly_as_plans(tmp_path, capsys, where, attack):
    """config.json and model_index.json get the plan file's bounded, strict reading: a 200k-deep nesting was a
    RecursionError (exit 1), a FIFO hung. The VAE's config is also read as a sibling (its scale factor)."""
    import shutil

    from dm_cli.model.sources import PRESETS_DIR

    folder = tmp_path / "pipe"
    shutil.copytree(PRESETS_DIR / "tiny-sd15", folder)
    path = folder / where
    path.unlink()
    if attack == "deep":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif attack == "fifo":
        os.mkfifo(path)
    else:
        path.write_text('{"_class_name": "UNet2DConditionModel", "sample_size": NaN}')
    for command in (["inspect", folder], ["plan", folder, "--max-memory", "cpu=8GB", "-q"]):
        code, out, err = cli(capsys, *command)
        words = {"deep": "nested too deeply", "fifo": "", "nan": "NaN is not JSON"}[attack]  # a FIFO: "missing" or
        assert code == 2 and words in err and err.count("\n") == 1, (command, err)  # "not a regular file", never a hang
