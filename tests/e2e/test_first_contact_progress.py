"""Issue 23, round 2, items 3 and 7: tiny-wan traces at its default size, `dmap plan` says what it traces
while it traces, and a queue says how far it is, how to resume after Ctrl-C and what it loaded."""

import io
import json
import re
import time

import pytest
from conftest import run_dmap

torch = pytest.importorskip("torch")

TORCHRUN_RANK1 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


# --- item 3: tiny-wan at its default size, progress while planning -------------------------------


def test_tiny_wan_transformer_traces_at_the_default_size():
    """480x832x81: 52 patches across, more than the 32 rotary positions tiny-wan had (the trace failed with
    "shape '[1, 1, 52, -1]' is invalid for input of size 128")."""
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.trace.trace import trace_component

    comp = resolve_source("tiny-wan").component("transformer")
    trace = trace_component(comp, "WanPipeline", InputSpec(480, 832, num_frames=81), "bf16", use_cache=False)
    assert trace.fallback_warning is None, trace.fallback_warning
    assert trace.activation_peak > 0
    assert trace.inputs["kwargs"]["hidden_states"]["shape"] == [1, 16, 21, 60, 104]


def test_tiny_wan_plans_with_an_activation_estimate_where_it_had_none():
    # 528 px wide: 33 patches, one more than tiny-wan's rotary embedding held; small enough to plan fast
    code, out, err = run_dmap("plan", "tiny-wan", "--height", 64, "--width", 528, "--frames", 5,
                              "--max-memory", "0=1GB", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert not [w for w in plan["warnings"] if "no activation estimate" in w], plan["warnings"]
    for name in ("transformer", "transformer_2"):
        assert plan["components"][name]["activation_peak_bytes"] > 0


def test_plan_reports_progress_naming_each_component_it_traces():
    from dm_cli import api

    messages = []
    api.plan("tiny-wan", max_memory="0=1GB", height=64, width=64, num_frames=5, use_cache=False,
                    on_progress=messages.append)
    assert all(isinstance(m, str) and m for m in messages)
    traced = [m for m in messages if m.startswith("Tracing ")]
    for name in ("text_encoder", "transformer", "transformer_2", "vae"):
        assert any(m.startswith(f"Tracing {name} (") for m in traced), messages
        assert any(m.startswith(f"Sizing {name} (") for m in messages), messages
    assert any("decode 5 frames" in m for m in traced), traced  # the call is named, not only the component

    cached = []  # a plan again reads the trace from the cache, and says so
    for _ in range(2):
        cached.clear()
        api.plan("tiny-wan", max_memory="0=1GB", height=64, width=64, num_frames=5, component="vae",
                        on_progress=cached.append)
    assert any(m.startswith("vae (AutoencoderKLWan): trace read from the cache") for m in cached), cached


def test_plan_spinner_redraws_elapsed_seconds_while_one_step_runs():
    """One long trace still moves the spinner: a timer thread redraws it (here every 0.05 s, 1 s in the CLI)."""
    from dm_cli.render.queue import TickingStatus

    drawn = []

    class Recorder:
        def start(self):
            pass

        def stop(self):
            pass

        def update(self, text):
            drawn.append(str(text))

    ticker = TickingStatus("Planning tiny-wan", interval=0.05)
    ticker.enabled = True
    ticker._make_status = Recorder
    with ticker:
        ticker("Tracing vae (AutoencoderKLWan) on the meta device: decode 81 frames")
        deadline = time.monotonic() + 30  # a loaded machine may run the ticker's thread late: wait for it, not 0.4 s
        while len(drawn) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(drawn) >= 4, drawn
    assert all(d.startswith("Tracing vae (AutoencoderKLWan)") and re.search(r"\d+ s \(all: \d+ s\)", d) for d in drawn)


# --- item 7: the queue --------------------------------------------------------------------------

QUEUE_ARGS = ["--height", 64, "--width", 64, "--steps", 2, "--seed", 3, "--mode", "staged"]


@pytest.fixture
def three_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red fox\na blue whale\na green tree\n")
    return path


def test_queue_says_item_k_of_n_with_an_eta_and_a_plain_closing_line(three_prompts, tmp_path):
    code, out, err = run_dmap("run", "--prompts", three_prompts, "--output", tmp_path / "out", "--chunk-size", 1,
                              *QUEUE_ARGS)
    assert code == 0, err
    assert re.search(r"item 1 of 3, ETA \d+ (s|min)", out), out
    assert re.search(r"item 2 of 3, ETA \d+ (s|min).* for the 1 left", out), out
    assert "item 3 of 3, the last one" in out, out
    closing = next(line for line in out.splitlines() if line.startswith("Each stage loads"))
    assert "0x" not in closing and "in 0.0 s" not in closing, closing
    assert re.search(r"once per chunk: encode \(text_encoder, text_encoder_2\) loaded 3 times \((?:under )?[0-9.]+ s\)(, ran (?:under )?[0-9.]+ s)?;", closing), closing
    assert not re.search(r"Stages: encode loaded", out)


def test_ctrl_c_during_a_queue_says_the_same_command_resumes(three_prompts, tmp_path, monkeypatch):
    import dm_cli.io.outputs as outputs

    real, calls = outputs.save_images, []

    def interrupted_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(outputs, "save_images", interrupted_on_the_second)
    args = ["run", "--prompts", three_prompts, "--output", tmp_path / "out", *QUEUE_ARGS]
    code, out, err = run_dmap(*args)
    assert code == 130, (out, err)
    assert "Queue interrupted: 1 of 3 item(s) written this run are kept; run the same command again to resume" in err, err
    monkeypatch.setattr(outputs, "save_images", real)
    code, out, err = run_dmap(*args)  # the same command: only the two missing items
    assert code == 0, err
    assert "Skipping 1 item(s)" in out and "item 2 of 2, the last one" in out, out


def test_ctrl_c_with_no_resume_says_how_to_resume(three_prompts, tmp_path, monkeypatch):
    from dm_cli.render.queue import QueueView

    view = QueueView()
    view.err = _terminal()
    view.resume, view.started, view.todo, view.done = False, 0.0, 3, 1
    view.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert "without --no-resume" in view.err.file.getvalue()


def _terminal():
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=True, width=200, markup=False, highlight=False)  # as render.console


def test_no_rank_draws_live_spinners_under_torchrun(monkeypatch):
    """Ranks share a terminal: a spinner's redraws on rank 0 ran into rank 1's lines (first contact, round 3)."""
    from dm_cli.render.queue import QueueView, TickingStatus, live_allowed

    for key, value in TORCHRUN_RANK1.items():
        monkeypatch.setenv(key, value)
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert not live_allowed()
        view = QueueView()
        view.err = _terminal()
        view.status("Loading transformer")
        view.step(1, 2, "transformer")
        assert view._status is None and view._progress is None
        assert f"[rank {rank}/2] Loading transformer" in view.err.file.getvalue()
        monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
        assert not TickingStatus("Planning").enabled
    for key in TORCHRUN_RANK1:
        monkeypatch.delenv(key)
    assert live_allowed()  # one process: its spinner
    view = QueueView()
    view.err = _terminal()
    view.status("Loading transformer")
    try:
        assert view._status is not None
    finally:
        view.status(None)
