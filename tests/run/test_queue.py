"""The prompts file, item seeds and names, resume detection, the manifest, torchrun rank handling (no torch)."""

import json
import os
from types import SimpleNamespace

import pytest

from dm_cli.errors import UsageError
from dm_cli.inputs import Generation
from dm_cli.io.outputs import is_complete
from dm_cli.run.distributed import Ranks, select_gpus
from dm_cli.run.sessions.queue import (
    MANIFEST,
    QueueItem,
    append_record,
    chunk_size_for,
    chunks,
    items_for_rank,
    merge_records,
    previous_records,
    read_prompts,
    read_records,
    remove_stale_temporaries,
    write_manifest,
)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_text_file_one_prompt_per_line_seeds_and_names(tmp_path):
    items = read_prompts(_write(tmp_path, "p.txt", "a fox\n\n  a cat  \r\na dog\n"), base_seed=10)
    assert [(i.index, i.prompt, i.seed, i.output) for i in items] == [
        (0, "a fox", 10, "00000.png"), (1, "a cat", 11, "00001.png"), (2, "a dog", 12, "00002.png")]
    assert items[0].steps is None and items[0].guidance_scale is None and items[0].negative_prompt is None


def test_jsonl_per_item_fields_and_defaults(tmp_path):
    lines = [
        {"prompt": "a fox"},
        {"prompt": "a cat", "seed": 99, "steps": 3, "guidance_scale": 7, "negative_prompt": "blur", "output": "cat"},
        {"prompt": "a dog", "output": "dog.png"},
    ]
    path = _write(tmp_path, "p.txt", "\n".join(json.dumps(x) for x in lines))  # detected by its first line
    items = read_prompts(path, base_seed=5)
    assert read_prompts(path, base_seed=2**64 - 3)[0].seed == 2**64 - 3  # the range --seed takes with --prompt
    with pytest.raises(UsageError, match="--seed -3 is out of range"):  # torch would wrap it: refused as with --prompt
        read_prompts(path, base_seed=-3)
    assert items[0] == QueueItem(0, "a fox", 5, "00000.png")
    assert items[1] == QueueItem(1, "a cat", 99, "cat.png", Generation(negative_prompt="blur", steps=3, guidance_scale=7.0))
    assert items[2].seed == 7 and items[2].output == "dog.png"


@pytest.mark.parametrize("text, message", [
    ("", "has no prompts"),
    ("\n  \n", "has no prompts"),
    ('{"prompt": "a"}\nnot json', "line 2 is not a JSON object"),
    ('{"prompt": "a"}\n[1]', "line 2 is not a JSON object"),
    ('{"prompt": ""}', "non-empty string 'prompt'"),
    ('{"prompt": "a", "sede": 1}', "unknown key"),
    ('{"prompt": "a", "seed": 1.5}', "'seed' must be an integer"),
    ('{"prompt": "a", "seed": true}', "'seed' must be an integer"),
    ('{"prompt": "a", "seed": 18446744073709551616}', "the seed 18446744073709551616 is out of range"),
    ('{"prompt": "a", "steps": 0}', "'steps' must be a whole number >= 1"),
    ('{"prompt": "a", "guidance_scale": "7"}', "'guidance_scale' must be a number"),
    ('{"prompt": "a", "output": "../x.png"}', "plain file name"),
    ('{"prompt": "a", "output": "/etc/x.png"}', "plain file name"),
    ('{"prompt": "a", "output": ".hidden.png"}', "plain file name"),
    ('{"prompt": "a", "output": "manifest.jsonl"}', "manifest"),
    ('{"prompt": "a", "output": "x"}\n{"prompt": "b", "output": "x.png"}', "both write x.png"),
    ('{"prompt": "a"}\n{"prompt": "b", "output": "00000.png"}', "both write 00000.png"),
    ('{"prompt": "a", "negative_prompt": 3}', "'negative_prompt' must be a string"),
])
def test_bad_prompt_files_are_one_sentence(tmp_path, text, message):
    with pytest.raises(UsageError, match=message):
        read_prompts(_write(tmp_path, "p.jsonl", text))


def test_unreadable_prompt_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        read_prompts(tmp_path / "nope.txt")
    os.mkfifo(tmp_path / "fifo.txt")  # reading it would block forever
    with pytest.raises(UsageError, match="not a regular file"):
        read_prompts(tmp_path / "fifo.txt")
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"a fox\n\xff\xfe\x00")
    with pytest.raises(UsageError, match="not UTF-8"):
        read_prompts(bad)


def test_ranks_share_items_round_robin_and_cover_the_queue(tmp_path):
    items = read_prompts(_write(tmp_path, "p.txt", "\n".join(f"p{i}" for i in range(7))))
    shares = [items_for_rank(items, r, 3) for r in range(3)]
    assert [[i.index for i in s] for s in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert items_for_rank(items, 0, 1) == items


def _png(path, meta, size=(8, 8)):
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in meta.items():
        info.add_text(key, value)
    Image.new("RGB", size, (10, 20, 30)).save(path, format="PNG", pnginfo=info)


def _meta(**changes):
    meta = {"prompt": "a fox", "seed": "3", "steps": "2", "guidance_scale": "3.5", "height": "8", "width": "8",
            "source": "demo", "plan_digest": "0123456789abcdef", "dmap_version": "0.1.0"}
    return {**meta, **changes}


def test_is_complete_checks_pixels_and_metadata(tmp_path):
    expected = _meta()
    path = tmp_path / "00000.png"
    assert is_complete(path, expected) == (False, "missing")
    _png(path, expected)
    assert is_complete(path, expected) == (True, "complete")
    assert is_complete(path, _meta(plan_digest="another plan", dmap_version="9")) == (True, "complete")
    assert is_complete(path, _meta(seed="4")) == (False, "made for another seed")
    assert is_complete(path, _meta(steps="3")) == (False, "made for another steps")
    assert is_complete(path, _meta(negative_prompt="blur")) == (False, "made for another negative prompt")
    assert is_complete(path, _meta(tiled_decode="vae")) == (False, "made for another tiled decode")  # seams differ
    _png(path, expected, size=(8, 16))
    assert is_complete(path, expected) == (False, "made for another size")
    _png(path, expected)
    path.write_bytes(path.read_bytes()[:-30])  # truncated: the IDAT/IEND chunks are gone
    assert is_complete(path, expected) == (False, "unreadable")


def test_stale_temporaries_of_an_item_are_removed_and_no_others(tmp_path):
    item = QueueItem(1, "p", 1, "00001.png")
    (tmp_path / ".00001.png.abc.tmp").write_bytes(b"half")
    (tmp_path / ".00002.png.abc.tmp").write_bytes(b"another rank's")
    remove_stale_temporaries(tmp_path, item)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".00002.png.abc.tmp"]


def test_manifest_appends_whole_lines_and_ignores_torn_ones(tmp_path):
    path = tmp_path / MANIFEST
    append_record(path, {"item": 0, "file": "00000.png", "prompt": "a", "seed": 0})
    append_record(path, {"item": 1, "file": "00001.png", "prompt": "b", "seed": 1})
    with open(path, "a") as handle:
        handle.write('{"item": 2, "file": "000')  # a writer killed mid-line
    assert [r["item"] for r in read_records(path)] == [0, 1]
    assert read_records(tmp_path / "missing.jsonl") == []


def test_merged_manifest_is_ordered_keeps_earlier_records_for_skipped_items(tmp_path):
    items = [QueueItem(i, f"p{i}", i, f"{i:05d}.png") for i in range(4)]
    append_record(tmp_path / "manifest-rank1.jsonl", {"item": 1, "file": "00001.png", "prompt": "p1", "seed": 1,
                                                       "seconds": 2.5, "rank": 1})
    append_record(tmp_path / MANIFEST, {"item": 3, "file": "00003.png", "prompt": "OLD", "seed": 3, "rank": 0})
    previous = previous_records(tmp_path)
    this_run = {
        2: {"item": 2, "file": "00002.png", "prompt": "p2", "seed": 2, "seconds": 1.0, "rank": 0},
        1: {"item": 1, "file": "00001.png", "prompt": "p1", "seed": 1, "seconds": None, "rank": 0, "resumed": True},
        3: {"item": 3, "file": "00003.png", "prompt": "p3", "seed": 3, "seconds": None, "rank": 1, "resumed": True},
    }
    merged = merge_records(items, this_run, previous)
    assert [r["item"] for r in merged] == [1, 2, 3]  # item 0 did not finish: no record
    assert merged[0]["seconds"] == 2.5 and merged[0]["rank"] == 1  # the earlier run's record
    assert merged[2]["prompt"] == "p3"  # the earlier record was for another prompt
    write_manifest(tmp_path, merged)
    assert [json.loads(line)["item"] for line in (tmp_path / MANIFEST).read_text().splitlines()] == [1, 2, 3]
    assert not list(tmp_path.glob("manifest-rank*"))


def test_chunk_size_from_budget():
    assert chunk_size_for(10_000, 1_000, 6) == 6
    assert chunk_size_for(2_500, 1_000, 6) == 2
    assert chunk_size_for(10, 1_000, 6) == 1
    assert chunk_size_for(10, 0, 6) == 6
    assert chunks(list(range(5)), 2) == [[0, 1], [2, 3], [4]]


def test_ranks_from_torchrun_environment():
    assert Ranks.from_env({}) == Ranks(0, 1, 0, 1) and not Ranks.from_env({}).distributed
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
           "MASTER_PORT": "29500"}  # more bad launches: test_hostile_env.py
    assert Ranks.from_env(env) == Ranks(3, 4, 1, 2)
    with pytest.raises(UsageError, match="RANK is not"):
        Ranks.from_env({"WORLD_SIZE": "2"})
    with pytest.raises(UsageError, match="not an integer"):
        Ranks.from_env({"WORLD_SIZE": "2", "RANK": "x"})
    with pytest.raises(UsageError, match="Inconsistent"):
        Ranks.from_env({"WORLD_SIZE": "2", "RANK": "2"})


def test_gpu_groups_per_local_rank():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}
    assert select_gpus(Ranks(3, 4, 1, 2), 2, env) == ["2", "3"] and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    env = {"CUDA_VISIBLE_DEVICES": "7,5,3,1"}  # an existing selection is narrowed, in its order
    assert select_gpus(Ranks(1, 2, 1, 2), 2, env) == ["3", "1"]
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert select_gpus(Ranks(0, 2, 0, 2), 0, env) == [] and env["CUDA_VISIBLE_DEVICES"] == ""
    assert select_gpus(Ranks(), None, env) is None
    with pytest.raises(UsageError, match="has 3 visible"):
        select_gpus(Ranks(1, 2, 1, 2), 2, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    with pytest.raises(UsageError, match="0 or more"):
        select_gpus(Ranks(), -1, {})


def test_queue_notices_print_as_text_not_markup(capsys):
    """The console takes no markup (text from files must stay text): a notice is styled, not wrapped in tags."""
    from dm_cli.render.queue import QueueView
    from dm_cli.run.sessions.queue_runner import QueueResult

    view = QueueView()
    view.start(QueueResult("out", 0, 1, 2, 2, notices=["The demo pipeline has RANDOM weights."], mode="staged"))
    out = capsys.readouterr()
    text = out.out + out.err
    assert "The demo pipeline has RANDOM weights." in text and "[bold" not in text and "[/]" not in text


def test_a_queue_item_takes_the_runs_negative_prompt_and_steps_unless_it_has_its_own():
    """Session.job_for settles an item against the run's job (--negative-prompt, --steps): the one place it
    happens, for the CLI queue and the API alike; the refusal sees the prompt that will really be used."""
    from dm_cli.errors import UsageError
    from dm_cli.families import Job, family_for
    from dm_cli.inputs import Generation
    from dm_cli.model.sources import resolve_source
    from dm_cli.run.sessions.session import Session

    pipe = object.__new__(Session)  # job_for needs only the family and the run's settled job (the Session keeps it)
    generation = Generation(height=64, width=64, steps=5, guidance_scale=7.5, negative_prompt="blur", num_images=1)
    pipe.settled = SimpleNamespace(family=family_for("StableDiffusionPipeline"),
                                   source=resolve_source("tiny-sd15"),  # its configs: the rules applied to each item
                                   generation=generation, defaults=Job.of(generation, "", 0))
    plain, own = QueueItem(0, "a fox", 3, "a.png"), QueueItem(1, "a cat", 4, "b.png", Generation(negative_prompt="dark", steps=2, guidance_scale=1.5))
    assert (pipe.job_for(plain).negative_prompt, pipe.job_for(plain).steps) == ("blur", 5)
    assert (pipe.job_for(own).negative_prompt, pipe.job_for(own).steps, pipe.job_for(own).guidance_scale) == \
        ("dark", 2, 1.5)
    pipe.settled.family, pipe.settled.source = family_for("FluxPipeline"), resolve_source("tiny-flux")  # guidance-distilled: the run's negative prompt is refused per item
    with pytest.raises(UsageError, match="Item 0"):
        pipe.job_for(plain)


def test_an_items_settings_are_one_generation_given_over_the_runs():
    """A queue item restates no setting: what its line gives is a Generation (`given`), laid over the run's by one
    function, a field left at its default the run's. Only `loras` shares a name: an item's are choices among the
    loaded adapters, not adapters."""
    from dataclasses import fields

    assert {f.name for f in fields(QueueItem)} & {f.name for f in fields(Generation)} == {"loras"}
    run = Generation(height=64, width=64, steps=8, guidance_scale=3.5, negative_prompt="blur", batch_size=2,
                     settings=(("true_cfg_scale", 4.0),))
    given = Generation(steps=2, guidance_scale=0.0, settings=(("guidance_scale_2", 1.0),))
    merged = given.given_over(run)
    assert (merged.steps, merged.guidance_scale, merged.negative_prompt, merged.batch_size, merged.height) == \
        (2, 0.0, "blur", 2, 64)  # a guidance of 0.0 is given (not a default), the batch and size are the run's
    assert merged.settings == (("guidance_scale_2", 1.0), ("true_cfg_scale", 4.0))
    assert Generation().given_over(run) == run
    item = QueueItem(0, "a fox", 1, "a.png", given)
    assert (item.steps, item.guidance_scale, item.settings) == (2, 0.0, given.settings)
    assert item.to_json()["steps"] == 2 and item.to_json()["negative_prompt"] is None
