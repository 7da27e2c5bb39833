"""Hostile input, round 2 (issue 18), items 1-3: folders planted beside a model or an output, written as
attacks. Nothing a planted `.NAME.dmap-*` folder says may change anything outside the swap folder and the
source's own folder; outputs replace only what dmap could have written.
"""

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile import assert_same_state, cli, component, loaded

from dm_cli.errors import DmapError
from dm_cli.io import swap as swap_module
from dm_cli.model import shard as shard_module


def dead_pid() -> int:
    """A PID no process has now (a child that has exited and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def snapshot(root: Path) -> dict:
    """Every entry under root, links never followed: kind, mode and bytes (or link target)."""
    found = {}
    for current, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(current) / name
            info = os.lstat(path)
            rel = path.relative_to(root).as_posix()
            if stat.S_ISLNK(info.st_mode):
                found[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                found[rel] = ("file", info.st_mode, path.read_bytes())
            else:
                found[rel] = ("other", info.st_mode)
    return found


def plant_swap(beside: Path, folder: str, payload: dict[str, bytes], old: list[str], new_dir: str = "payload",
               root: str | None = None, pid: int | None = None) -> Path:
    """A `.NAME.dmap-swap-PID-*` folder as an attacker would ship it next to NAME."""
    swap = beside.parent / f".{beside.name}.dmap-swap-{pid or dead_pid()}-deadbeef"
    (swap / new_dir).mkdir(parents=True)
    for name, data in payload.items():
        (swap / new_dir / name).write_bytes(data)
    journal = {"format": "dmap-swap", "version": 1, "root": root or str(beside.resolve()),
               "folders": [{"folder": folder, "new_dir": new_dir, "old": old, "new": list(payload)}]}
    (swap / "dmap-swap.json").write_text(json.dumps(journal))
    return swap


@pytest.fixture
def planted(tmp_path):
    """A model folder `src` with a swap folder beside it whose journal names a folder elsewhere on disk."""
    component(tmp_path / "src")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.safetensors").write_bytes(b"the user's own weights")
    swap = plant_swap(tmp_path / "src", str(victim), {"evil.safetensors": b"attacker"}, ["precious.safetensors"])
    return tmp_path, victim, swap


# --- 1. planted swap journals --------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["--max-shard-size", "bogus"],  # fails on its arguments: touches nothing, not even the swap folder
    ["-s", "0"],  # not --in-place: refuses, naming the swap folder
    ["-s", "0", "--in-place"],  # --in-place, but the journal names a folder that is not the source's
    ["-s", "0", "--in-place", "--dry-run"],
])
def test_1_planted_journal_naming_another_folder_touches_nothing(planted, capsys, args):
    tmp_path, victim, swap = planted
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "shard", tmp_path / "src", *args)
    assert code == 2, err
    assert snapshot(tmp_path) == before
    if args[0] != "--max-shard-size":
        assert str(swap) in err, err


def test_1_other_commands_refuse_a_planted_swap_and_name_it(planted, capsys):
    tmp_path, victim, swap = planted
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "inspect", tmp_path / "src")
    assert code == 2 and str(swap) in err, err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("attack", ["other-root", "dotdot-name", "absolute-name", "extra-file", "link-in-swap",
                                    "not-weights", "link-folder", "duplicate-folder"])
def test_1_journal_that_swap_in_place_could_not_have_written_is_refused(tmp_path, capsys, attack):
    """Each a journal about the source's own folder, but with one thing the swap mechanism never writes."""
    src = tmp_path / "src"
    component(src)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.safetensors").write_bytes(b"keep")
    folder, old, payload = str(src.resolve()), ["diffusion_pytorch_model.safetensors"], {"new.safetensors": b"x"}
    root = None
    if attack == "other-root":
        root = str((tmp_path / "elsewhere").resolve())
    elif attack == "dotdot-name":
        old = ["../elsewhere/x.safetensors"]
    elif attack == "absolute-name":
        old = [str(tmp_path / "elsewhere" / "x.safetensors")]
    elif attack == "not-weights":
        old = ["config.json"]
    elif attack == "link-folder":
        (src / "linked").symlink_to(tmp_path / "elsewhere")
        folder = str(src / "linked")
    swap = plant_swap(src, folder, payload, old, new_dir="linked" if attack == "link-folder" else "", root=root)
    if attack == "extra-file":
        (swap / "notes.txt").write_text("not listed")
    elif attack == "link-in-swap":
        os.remove(swap / "new.safetensors")
        (swap / "new.safetensors").symlink_to(tmp_path / "elsewhere" / "x.safetensors")
    elif attack == "duplicate-folder":
        journal = json.loads((swap / "dmap-swap.json").read_text())
        journal["folders"].append(dict(journal["folders"][0]))
        (swap / "dmap-swap.json").write_text(json.dumps(journal))
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "shard", src, "-s", "0", "--in-place")
    assert code == 2 and str(swap) in err and "nothing was changed" in err, err
    assert snapshot(tmp_path) == before


def test_1_a_genuine_interrupted_swap_still_finishes(tmp_path, monkeypatch):
    """The same checks pass what swap_in_place writes: a kill right after the commit is finished by --in-place."""
    src = tmp_path / "src"
    state = component(src)
    real = swap_module._roll_forward

    def killed(swap, journal):
        raise KeyboardInterrupt  # the process dies right after the commit point

    monkeypatch.setattr(swap_module, "_roll_forward", killed)
    monkeypatch.setattr(swap_module, "_pid_alive", lambda pid: False)
    with pytest.raises(KeyboardInterrupt):
        shard_module.shard(str(src), 1500, in_place=True, min_shard_size=1)
    monkeypatch.setattr(swap_module, "_roll_forward", real)
    with pytest.raises(DmapError, match="half-swapped"):  # not --in-place: refused
        shard_module.shard(str(src), 1500, output=tmp_path / "out", min_shard_size=1)
    result = shard_module.shard(str(src), 1500, in_place=True, min_shard_size=1)
    assert any("Finished an interrupted --in-place swap" in done for done in result.removed_stale)
    assert_same_state(loaded(src), state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # the swap folder is gone


def test_1_planted_replaced_output_is_not_made_the_output(tmp_path, capsys):
    """`.OUT.dmap-replaced-PID-*` beside the output: a run without --overwrite writes its own output and leaves
    the planted folder as it is (only a run allowed to replace OUT puts an interrupted --overwrite's old output back)."""
    state = component(tmp_path / "src")
    planted = tmp_path / f".out.dmap-replaced-{dead_pid()}-deadbeef"
    planted.mkdir()
    (planted / "config.json").write_text('{"_class_name": "Evil"}')
    before = snapshot(planted)
    code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "-o", tmp_path / "out")
    assert code == 0, err
    assert_same_state(loaded(tmp_path / "out"), state)
    assert snapshot(planted) == before


# --- 2. PIDs no process can have ------------------------------------------------------------------------


@pytest.mark.parametrize("pid", ["99999999999999999999999", "9" * 200, "0"])
@pytest.mark.parametrize("mark", ["tmp", "swap", "replaced"])
def test_2_absurd_pid_in_a_hidden_folder_is_not_ours(tmp_path, capsys, pid, mark):
    component(tmp_path / "src")
    hidden = tmp_path / f".src.dmap-{mark}-{pid}-xx"
    hidden.mkdir()
    (hidden / "dmap-swap.json").write_text("{}")
    before = snapshot(hidden)
    code, out, err = cli(capsys, "inspect", tmp_path / "src")
    assert code == 0, err
    code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "--in-place")
    assert code == 0, err
    assert snapshot(hidden) == before  # not a folder dmap wrote: left alone


# --- 3. --overwrite replaces only what dmap could have written -------------------------------------------


def _special(kind: str, path: Path, tmp_path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("creating a device node needs root")
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # like /dev/null
    elif kind == "link":
        (tmp_path / "target.json").write_text("the link's target")
        path.symlink_to(tmp_path / "target.json")
    elif kind == "folder":
        path.mkdir()
        (path / "notes.txt").write_text("mine")


@pytest.mark.parametrize("kind", ["fifo", "device", "link", "folder"])
def test_3_plan_overwrite_never_replaces_a_device_fifo_link_or_folder(tmp_path, capsys, kind):
    target = tmp_path / "plan.json"
    _special(kind, target, tmp_path)
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "plan", "tiny-flux", "--max-memory", "0=1GB", "-o", target, "--overwrite", "-q")
    assert code == 2 and str(target) in err and "--overwrite replaces only" in err, err
    assert snapshot(tmp_path) == before


def test_3_plan_overwrite_replaces_a_regular_file(tmp_path, capsys):
    target = tmp_path / "plan.json"
    target.write_text("old plan")
    code, out, err = cli(capsys, "plan", "tiny-flux", "--max-memory", "0=1GB", "-o", target, "--overwrite", "-q")
    assert code == 0, err
    assert json.loads(target.read_text())["format"].startswith("dmap-plan")


@pytest.mark.parametrize("kind", ["fifo", "link", "folder"])
def test_3_shard_overwrite_replaces_only_a_folder_dmap_could_have_written(tmp_path, capsys, kind):
    component(tmp_path / "src")
    target = tmp_path / "out"
    _special(kind, target, tmp_path)
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "shard", tmp_path / "src", "-s", "0", "-o", target, "--overwrite")
    assert code == 2 and ("--overwrite replaces only" in err or kind == "link" and "is not a folder" in err), err
    assert snapshot(tmp_path) == before


# --- the recovery property -------------------------------------------------------------------------------

_NAMES = st.sampled_from(["a.safetensors", "diffusion_pytorch_model.safetensors", "../x.safetensors", "..", ".",
                          "/abs/y.safetensors", "config.json", "dmap-swap.json", ".old-0", "sub/z.safetensors",
                          "m.safetensors.index.json", "", "evil\0.safetensors"])
_FOLDERS = st.sampled_from(["SRC", "SRC/unet", "SRC/link", "SRC/..", "OUTSIDE", "/", "SRC/../outside", "relative"])


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(folders=st.lists(st.tuples(_FOLDERS, st.sampled_from(["", "unet", "..", "link", ".old-0", "x/y"]),
                                  st.lists(_NAMES, max_size=3), st.lists(_NAMES, max_size=3)), min_size=1, max_size=3),
       root=st.sampled_from(["SRC", "OUTSIDE", "SRC/unet"]),
       extra=st.sampled_from([None, "file", "link-file", "link-dir", "missing"]))
def test_recovery_never_changes_anything_outside_the_swap_folder_and_the_source(tmp_path_factory, folders, root, extra):
    base = tmp_path_factory.mktemp("prop")
    src, outside = base / "models" / "src", base / "outside"
    (src / "unet").mkdir(parents=True)
    (src / "model_index.json").write_text("{}")
    (src / "unet" / "a.safetensors").write_bytes(b"a")
    (src / "diffusion_pytorch_model.safetensors").write_bytes(b"d")
    (src / "link").symlink_to(outside)
    outside.mkdir()
    (outside / "a.safetensors").write_bytes(b"outside a")
    (outside / "x.safetensors").write_bytes(b"outside x")
    places = {"SRC": str(src), "OUTSIDE": str(outside), "SRC/unet": str(src / "unet")}

    def place(text: str) -> str:
        for key in sorted(places, key=len, reverse=True):
            if text.startswith(key):
                return places[key] + text[len(key):]
        return text

    swap = src.parent / f".src.dmap-swap-{dead_pid()}-deadbeef"
    swap.mkdir()
    entries = []
    for folder, new_dir, old, new in folders:
        holder = swap / new_dir if new_dir else swap
        for name in new:
            try:
                holder.mkdir(parents=True, exist_ok=True)
                (holder / name).write_bytes(b"new " + name.encode(errors="replace"))
            except (OSError, ValueError):
                pass
        entries.append({"folder": place(folder), "new_dir": new_dir, "old": old, "new": new})
    if extra == "file":
        (swap / "extra.safetensors").write_bytes(b"extra")
    elif extra == "link-file":
        (swap / "a.safetensors").unlink(missing_ok=True)
        (swap / "a.safetensors").symlink_to(outside / "a.safetensors")
    elif extra == "link-dir" and not os.path.lexists(swap / ".old-0"):
        (swap / ".old-0").symlink_to(outside)
    (swap / "dmap-swap.json").write_text(json.dumps({"format": "dmap-swap", "version": 1, "root": place(root),
                                                    "folders": entries}))
    allowed = ("models/src/", f"models/{swap.name}")  # the source's own folder and the swap folder

    def rest() -> dict:
        return {rel: what for rel, what in snapshot(base).items() if not rel.startswith(allowed)}

    rest_before = rest()
    try:
        swap_module.finish_swaps(src.resolve())
    except DmapError as error:
        assert str(swap) in str(error)
    except OSError:
        pass  # a journal that passed the checks may still meet a missing file: an error, never a write elsewhere
    assert rest() == rest_before
    assert os.path.islink(src / "link")
