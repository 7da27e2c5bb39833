"""Hostile input, round 2 (issue 18), written as attacks: the environment torchrun would set and the
demo pipeline dmap keeps in its cache. 10: a torchrun launch whose variables are missing or wrong is
exit 2 naming the variable, before anything loads or joins. 11: a damaged cached demo is found
without blocking and generated again (or, for a lock that cannot be used, exit 2 saying what to remove).
"""

import hashlib
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
from test_hostile import cli

from dm_cli.errors import UsageError

TIMEOUT_S = 30  # a hang is a failure, not a stuck suite


# --- helpers ----------------------------------------------------------------------------------------


def _unblock_fifos(root: Path) -> None:
    """Open every FIFO under root at both ends, then close: whoever waits on one (reader or writer) goes on."""
    for path in [root, *root.rglob("*")] if root.exists() else []:
        try:
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))
        except OSError:
            pass


def within(fn, root: Path, seconds: float = TIMEOUT_S):
    """fn() in a thread, which must finish in `seconds` (a FIFO read blocks forever: then the test fails)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the test below
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for _ in range(20):  # let the stuck call go on, so it does not outlive the test
            _unblock_fifos(root)
            thread.join(0.5)
            if not thread.is_alive():
                break
        pytest.fail(f"hung: still running after {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def tree(root: Path) -> dict:
    """Every entry under root: a digest for regular files, its kind for anything else."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        mode = os.lstat(path).st_mode
        if stat.S_ISREG(mode):
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[rel] = "dir" if stat.S_ISDIR(mode) else f"mode {stat.S_IFMT(mode):o}"
    return found


# --- 10. torchrun's variables --------------------------------------------------------------------------

LAUNCH = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
          "MASTER_PORT": "29500"}
TORCHRUN_KEYS = (*LAUNCH, "DMAP_DIST_TIMEOUT")
MISSING = None

BAD_LAUNCHES = {
    # name: (variable, value or MISSING), the variable the sentence must name
    "MASTER_ADDR missing": ("MASTER_ADDR", MISSING),
    "MASTER_ADDR empty": ("MASTER_ADDR", ""),
    "MASTER_ADDR with a newline": ("MASTER_ADDR", "host\nname"),
    "MASTER_PORT missing": ("MASTER_PORT", MISSING),
    "MASTER_PORT not a number": ("MASTER_PORT", "http"),
    "MASTER_PORT zero": ("MASTER_PORT", "0"),
    "MASTER_PORT too large": ("MASTER_PORT", "70000"),
    "MASTER_PORT negative": ("MASTER_PORT", "-1"),
    "timeout not a number": ("DMAP_DIST_TIMEOUT", "abc"),
    "timeout negative": ("DMAP_DIST_TIMEOUT", "-5"),
    "timeout zero": ("DMAP_DIST_TIMEOUT", "0"),
    "timeout inf": ("DMAP_DIST_TIMEOUT", "inf"),
    "timeout nan": ("DMAP_DIST_TIMEOUT", "nan"),
    "timeout huge": ("DMAP_DIST_TIMEOUT", "1" + "0" * 30),
    "timeout huge float": ("DMAP_DIST_TIMEOUT", "1e30"),
    "timeout empty": ("DMAP_DIST_TIMEOUT", ""),
    "RANK missing": ("RANK", MISSING),
    "RANK not an integer": ("RANK", "one"),
    "RANK a float": ("RANK", "1.0"),
    "RANK negative": ("RANK", "-1"),
    "RANK = WORLD_SIZE": ("RANK", "2"),
    "RANK huge": ("RANK", "9" * 5000),
    "RANK in other digits": ("RANK", "\u0661"),
    "WORLD_SIZE not an integer": ("WORLD_SIZE", "two"),
    "WORLD_SIZE zero": ("WORLD_SIZE", "0"),
    "WORLD_SIZE negative": ("WORLD_SIZE", "-2"),
    "WORLD_SIZE empty": ("WORLD_SIZE", ""),
    "LOCAL_RANK not an integer": ("LOCAL_RANK", "x"),
    "LOCAL_RANK negative": ("LOCAL_RANK", "-1"),
    "LOCAL_RANK = LOCAL_WORLD_SIZE": ("LOCAL_RANK", "2"),
    "LOCAL_WORLD_SIZE zero": ("LOCAL_WORLD_SIZE", "0"),
    "LOCAL_WORLD_SIZE over WORLD_SIZE": ("LOCAL_WORLD_SIZE", "3"),
}


@pytest.fixture
def launch(monkeypatch):
    """A torchrun-like environment; joining a process group or loading a pipeline fails the test."""
    import torch.distributed as dist

    import dm_cli.api

    def must_not_join(*args, **kwargs):
        raise AssertionError("init_process_group reached")

    def must_not_load(*args, **kwargs):
        raise AssertionError("a pipeline was loaded")

    monkeypatch.setattr(dist, "init_process_group", must_not_join)
    monkeypatch.setattr(dm_cli.api, "Session", must_not_load)
    for key in TORCHRUN_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in LAUNCH.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


@pytest.mark.parametrize("as_json", [False, True], ids=["view", "json"])
@pytest.mark.parametrize("case", list(BAD_LAUNCHES))
def test_10_torchrun_variables_are_checked_before_anything_joins(tmp_path, capsys, launch, case, as_json):
    """A missing MASTER_ADDR reached init_process_group (ValueError, exit 1), DMAP_DIST_TIMEOUT=abc was int()'s
    ValueError (exit 1) and -5 or 0 a wait that times out at once or never: each is exit 2, one sentence naming the
    variable, before the output folder is made or torch.distributed is touched."""
    key, value = BAD_LAUNCHES[case]
    if value is MISSING:
        launch.delenv(key)
    else:
        launch.setenv(key, value)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n")
    out_dir = tmp_path / "out"
    code, out, err = within(lambda: cli(capsys, "run", "--prompts", prompts, "--output", out_dir,
                                        *(["--json"] if as_json else [])), tmp_path)
    assert code == 2, (code, err)
    message = err.strip()
    assert message.startswith("Error: ") and "\n" not in message and key in message, message
    assert len(message) < 400, message  # a 5000-digit RANK is not echoed whole
    assert not out_dir.exists()


def test_10_a_good_launch_passes_its_timeout_to_the_process_group(launch):
    """The checks let torchrun's own environment through, and DMAP_DIST_TIMEOUT reaches init_process_group."""
    from datetime import timedelta

    import torch.distributed as dist

    from dm_cli.run.distributed import DEFAULT_TIMEOUT_S, Ranks

    assert Ranks.from_env() == Ranks(1, 2, 1, 2) and Ranks.from_env().timeout_s == DEFAULT_TIMEOUT_S
    launch.setenv("DMAP_DIST_TIMEOUT", "90")
    calls = []
    launch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append(kwargs))
    launch.setattr(dist, "is_initialized", lambda: False)
    Ranks.from_env().join()
    assert calls == [{"rank": 1, "world_size": 2, "timeout": timedelta(seconds=90)}]
    # one process (torchrun --nproc-per-node 1) joins no group: it needs no rendezvous nor timeout
    single = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "DMAP_DIST_TIMEOUT": "abc"}
    assert Ranks.from_env(single) == Ranks() and not Ranks.from_env(single).distributed
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        Ranks.from_env({**single, "WORLD_SIZE": "2"})


# --- 11. the cached demo pipeline ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The demo, generated once (into the session's cache, which other modules share): tests damage copies."""
    from dm_cli.model.demo import ensure_demo

    cache = os.environ.get("DMAP_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "dmap-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DMAP_CACHE_DIR", cache)
        return ensure_demo()


@pytest.fixture
def demo(pristine, tmp_path, monkeypatch):
    """A copy of the demo in this test's own cache; generating it again copies the pristine one (counted)."""
    import dm_cli.model.demo as demo_module

    cache = tmp_path / "cache"
    folder = cache / "demo" / pristine.name
    shutil.copytree(pristine, folder, symlinks=True)
    monkeypatch.setenv("DMAP_CACHE_DIR", str(cache))
    assert demo_module.demo_folder() == folder
    generated = []

    def write_random_pipeline(config_root, target, seed=0, max_shard_size=None, dtype="float32"):
        generated.append(Path(target))
        shutil.copytree(pristine, target, dirs_exist_ok=True)
        return Path(target)

    monkeypatch.setattr(demo_module, "write_random_pipeline", write_random_pipeline)
    return folder, generated


def _fifo(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)


def _shard(folder: Path, component: str = "transformer") -> Path:
    return sorted((folder / component).glob("*.safetensors"))[0]


def _outside(folder: Path, name: str, data: bytes | None = None) -> Path:
    target = folder.parent.parent.parent / "elsewhere" / name
    target.parent.mkdir(exist_ok=True)
    if data is not None:
        target.write_bytes(data)
    return target


def _symlink(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def _replace_folder_by_file(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.write_text("{}")


def _replace_folder_by_link(folder: Path) -> None:
    copy = _outside(folder, "demo-copy")
    shutil.copytree(folder, copy)
    shutil.rmtree(folder)
    folder.symlink_to(copy)


DAMAGE = {
    "model_index.json is a FIFO": lambda f: _fifo(f / "model_index.json"),
    "a config.json is a FIFO": lambda f: _fifo(f / "text_encoder" / "config.json"),
    "the scheduler config is a FIFO": lambda f: _fifo(f / "scheduler" / "scheduler_config.json"),
    "a tokenizer.json is a FIFO": lambda f: _fifo(f / "tokenizer_2" / "tokenizer.json"),
    "a weights index is a FIFO": lambda f: _fifo(f / "vae" / "diffusion_pytorch_model.safetensors.index.json"),
    "a shard is a FIFO": lambda f: _fifo(_shard(f)),
    "merges.txt is a FIFO": lambda f: _fifo(f / "tokenizer" / "merges.txt"),
    "an extra FIFO .json": lambda f: os.mkfifo(f / "transformer" / "extra.json"),
    "a component folder is a FIFO": lambda f: _fifo(f / "vae"),
    "a config is a symlink to a FIFO": lambda f: _symlink(f / "vae" / "config.json", _fifo_at(_outside(f, "fifo"))),
    "a config is a symlink to a copy": lambda f: _symlink(
        f / "vae" / "config.json", _outside(f, "config.json", (f / "vae" / "config.json").read_bytes())),
    "a shard is a dangling symlink": lambda f: _symlink(_shard(f), f / "nowhere"),
    "a config is a folder": lambda f: ((f / "vae" / "config.json").unlink(), (f / "vae" / "config.json").mkdir()),
    "a config is not JSON": lambda f: (f / "vae" / "config.json").write_text('{"_class_name": "Autoenc'),
    "a config holds NaN": lambda f: (f / "vae" / "config.json").write_text('{"scaling_factor": NaN}'),
    "a config is a list": lambda f: (f / "text_encoder" / "config.json").write_text("[1]"),
    "a config is not UTF-8": lambda f: (f / "transformer" / "config.json").write_bytes(b"\xff\xfe{}"),
    "model_index.json is missing": lambda f: (f / "model_index.json").unlink(),
    "a shard is missing": lambda f: _shard(f).unlink(),
    "a component's weights are missing": lambda f: [p.unlink() for p in (f / "text_encoder").glob("*.safetensors")],
    "a shard is truncated": lambda f: _shard(f).write_bytes(_shard(f).read_bytes()[:-100]),
    "a tokenizer file is missing": lambda f: (f / "tokenizer" / "vocab.json").unlink(),
    "a component folder is missing": lambda f: shutil.rmtree(f / "tokenizer_2"),
    "the demo folder is a file": _replace_folder_by_file,
    "the demo folder is a symlink": _replace_folder_by_link,
    "the demo folder is a FIFO": lambda f: _fifo(f),
}


def _fifo_at(path: Path) -> Path:
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("case", list(DAMAGE))
def test_11_a_damaged_cached_demo_is_generated_again_without_blocking(demo, capsys, case):
    """A FIFO anywhere in the demo (its model_index.json, a config.json) hung the integrity check; model_index.json
    missing, or the folder replaced by a file, made the rename of the new demo fail (exit 1); a symlink was
    followed out of the cache. Each is found by lstat before anything is opened, and the demo generated again:
    afterwards it is exactly the pristine one, real files only."""
    from dm_cli.model.demo import ensure_demo

    folder, generated = demo
    expected = tree(folder)
    DAMAGE[case](folder)
    assert within(ensure_demo, folder.parent.parent.parent) == folder
    assert len(generated) == 1, generated
    assert stat.S_ISDIR(os.lstat(folder).st_mode)
    rebuilt = tree(folder)
    rebuilt.pop(next((k for k in rebuilt if k not in expected), None), None)  # dmap's own record of the files
    assert rebuilt == expected
    assert sorted(p.name for p in folder.parent.iterdir()) == [".demo.lock", folder.name]  # no staging left
    assert within(ensure_demo, folder.parent.parent.parent) == folder and len(generated) == 1  # intact now


def test_11_an_intact_demo_is_used_as_it_is_and_stale_staging_is_cleaned(demo):
    """Nothing is generated for an intact demo; a staging folder a killed process left behind is removed."""
    from dm_cli.model.demo import ensure_demo

    folder, generated = demo
    before = tree(folder)
    (folder.parent / ".tmp-demo-killed").mkdir()
    (folder.parent / ".tmp-demo-killed" / "model_index.json").write_text("{}")
    assert ensure_demo() == folder and generated == []
    assert tree(folder) == before
    assert sorted(p.name for p in folder.parent.iterdir()) == [".demo.lock", folder.name]


LOCKS = {
    "a folder": lambda lock: lock.mkdir(),
    "a FIFO": lambda lock: os.mkfifo(lock),
    "a symlink to a file elsewhere": lambda lock: lock.symlink_to(_outside(lock.parent / "x", "victim", b"keep me")),
    "a dangling symlink": lambda lock: lock.symlink_to(_outside(lock.parent / "x", "created-by-dmap")),
}


@pytest.mark.parametrize("case", list(LOCKS))
def test_11_a_demo_lock_that_cannot_be_used_is_exit_2_saying_what_to_remove(demo, capsys, monkeypatch, case):
    """`.demo.lock` as a folder was IsADirectoryError (exit 1), as a FIFO open() waited for a writer forever, and
    as a symlink it was followed (a file created or locked outside the cache). Now: exit 2, one sentence naming
    the lock and saying to remove it, and nothing followed or generated."""
    import dm_cli.model.demo as demo_module

    folder, generated = demo
    lock = folder.parent / ".demo.lock"
    (folder.parent / "x").mkdir()  # keeps _outside's files inside this test's folder
    LOCKS[case](lock)
    elsewhere = tree(folder.parent.parent.parent / "elsewhere")

    def must_not_check(*args):
        raise AssertionError("the demo was checked without a lock")

    monkeypatch.setattr(demo_module, "_ensure_demo_locked", must_not_check)
    code, out, err = within(lambda: cli(capsys, "run", "-p", "a fox", "-o", folder.parent / "x" / "fox.png"),
                            folder.parent)
    assert code == 2, (code, err)
    message = err.strip()
    assert "\n" not in message and ".demo.lock" in message and "remove" in message, message
    assert tree(folder.parent.parent.parent / "elsewhere") == elsewhere and generated == []
    assert not (folder.parent / "x" / "fox.png").exists()


def test_11_a_cache_folder_that_is_a_file_is_exit_2(demo, capsys):
    """The demo's folder in the cache (`demo/`) replaced by a file: mkdir's FileExistsError was exit 1."""
    from dm_cli.model.demo import ensure_demo

    folder, generated = demo
    shutil.rmtree(folder.parent)
    folder.parent.write_text("not a folder")
    with pytest.raises(UsageError, match="remove it") as raised:
        within(ensure_demo, folder.parent.parent)
    assert str(folder.parent) in str(raised.value) and generated == []
