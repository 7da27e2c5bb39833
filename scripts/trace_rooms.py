"""The rooms a run request walks through, from `cli/run.py` to the pipeline call (issue 39).

Runs `dmap run SOURCE -p x --steps 2 -o OUT` in this process with a profile hook (sys.setprofile) and, until the
stage loop's first `run_job` (where the pipeline is called), counts:

- rooms: the distinct dm_cli modules whose functions ran;
- entries: calls from one dm_cli module into another (a room entered again counts again), in all and for the
  run layer's rooms (cli, api, run);
- returns into cli/run.py: calls made by cli/run.py's own code into another room that came back to it (each one a
  step the command line had to sequence itself);
- stays and climbs back up (issue 56): the walk seen from the run layer only, each moment in the run-layer room
  whose function runs (what it calls below the run layer, the planner, families, io, is part of that stay). A stay
  starts when that room changes: by a call (an entry) or by a return into a room the walk had left (a climb back
  up, a room that sequences steps itself: it called down, got an answer, and goes on). Counted for the whole walk
  and for its first 400 events (calls and returns of run-layer functions), as the issue measured;
- calls against the imports: a call from room A into room B where B imports A (directly or through others, per
  grimp's import graph): control climbing back up the house, a lower room calling a higher one through a callback
  it was handed (a status line, a progress bar, a hook). The house's layers forbid the imports, not these calls.

Usage: python scripts/trace_rooms.py [SOURCE] [--json]. SOURCE defaults to a random-weight tiny-flux written to a
temporary folder (as the tests make theirs); its files and the output are removed at the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import grimp

CLI_RUN = "dm_cli.cli.run"
# the rooms a run request is settled and sequenced in (the planner, the families and io below them are what they
# use; their entries are dominated by the planner's search loops)
RUN_LAYER = ("dm_cli.cli", "dm_cli.api", "dm_cli.run")


class Stop(Exception):
    """Raised from the profile hook's caller once the pipeline call is reached."""


def walk(source: str, output: str) -> dict:
    from dm_cli.cli import main

    rooms: list[str] = []
    entries: Counter = Counter()
    returns_into_cli: list[str] = []
    doors: list[str] = []  # each entry into a run-layer room: from where, into which function
    state = {"done": False}
    layer_stack: list[str] = []  # the run-layer rooms of the frames running, innermost last
    stays: list[tuple[str, str]] = []  # (how it began: "call" or "climb", room), in order
    events = [0]  # run-layer calls and returns so far
    climbs_at: list[int] = []  # the event count at each climb
    graph = grimp.build_graph("dm_cli")
    above: dict[str, set] = {}  # room -> the rooms it imports, directly or not
    upward: list[str] = []  # calls against the imports, "caller -> callee.function"

    def moved(how: str) -> None:
        room = layer_stack[-1] if layer_stack else ""
        if room and (not stays or stays[-1][1] != room):
            stays.append((how, room))
            if how == "climb":
                climbs_at.append(events[0])

    def module_of(frame) -> str:
        return frame.f_globals.get("__name__", "") or ""

    def hook(frame, event, arg):
        if state["done"] or event not in ("call", "return"):
            return
        here = module_of(frame)
        if not here.startswith("dm_cli") or frame.f_code.co_name == "<module>":  # imports are not the walk
            return
        caller = frame.f_back
        came_from = module_of(caller) if caller is not None else ""
        if event == "call" and here == "dm_cli.run.loops.stages" and frame.f_code.co_name == "run_job":
            state["done"] = True  # the pipeline call: the walk ends here
            return
        if here.startswith(RUN_LAYER):
            events[0] += 1
            if event == "call":
                layer_stack.append(here)
                moved("call")
            elif layer_stack:
                layer_stack.pop()
                moved("climb")
        if event == "call" and came_from.startswith("dm_cli") and came_from != here and here in graph.modules:
            if here not in above:
                above[here] = graph.find_upstream_modules(here)
            if came_from in above[here]:
                upward.append(f"{came_from} -> {here}.{frame.f_code.co_name}")
        if event == "call":
            if here not in rooms:
                rooms.append(here)
            if came_from.startswith("dm_cli") and came_from != here:
                entries[here] += 1
                if here.startswith(RUN_LAYER):
                    doors.append(f"{came_from} -> {here}.{frame.f_code.co_name}")
        elif came_from == CLI_RUN and here != CLI_RUN:
            returns_into_cli.append(f"{here}.{frame.f_code.co_name}")

    shown = io.StringIO()  # the plan and the progress the command draws: not this script's output
    sys.setprofile(hook)
    try:
        with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
            main(["run", source, "-p", "x", "--steps", "2", "-o", output])
    except SystemExit as done:
        code = done.code
    else:
        code = 0
    finally:
        sys.setprofile(None)
    run_layer = [room for room in rooms if room.startswith(RUN_LAYER)]
    climbs = [room for how, room in stays if how == "climb"]
    return {"calls_against_imports": len(upward), "calls_against_imports_list": upward, "stays": len(stays), "climbs_back_up": len(climbs), "run_layer_events": events[0],
            "climbs_in_first_400_events": sum(1 for at in climbs_at if at <= 400),
            "climbs_by_room": dict(Counter(climbs).most_common()),
            "stays_by_room": dict(Counter(room for _, room in stays).most_common()), "exit_code": code, "reached_pipeline_call": state["done"], "rooms": len(rooms),
            "entries": sum(entries.values()), "run_layer_rooms": len(run_layer),
            "run_layer_entries": sum(entries[room] for room in run_layer),
            "returns_into_cli_run": len(returns_into_cli), "room_list": rooms,
            "run_layer_entries_by_room": {room: entries[room] for room in run_layer},
            "entries_by_room": dict(entries.most_common()), "returns": returns_into_cli, "run_layer_doors": doors}


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--json"]
    with tempfile.TemporaryDirectory() as folder:
        os.environ["DMAP_CACHE_DIR"] = str(Path(folder) / "cache")  # a cold cache: the same walk every time
        if args:
            source = args[0]
        else:
            from dm_cli.model.demo import write_random_pipeline
            from dm_cli.model.sources import PRESETS_DIR

            source = str(write_random_pipeline(PRESETS_DIR / "tiny-flux", Path(folder) / "tiny-flux", seed=0))
        found = walk(source, str(Path(folder) / "out.png"))
    if "--json" in sys.argv:
        print(json.dumps(found, indent=1))
    else:
        print(f"exit {found['exit_code']}, reached the pipeline call: {found['reached_pipeline_call']}")
        print(f"rooms (distinct dm_cli modules): {found['rooms']}")
        print(f"entries (calls from one dm_cli module into another): {found['entries']}")
        print(f"run-layer rooms (cli, api, run): {found['run_layer_rooms']}, entered {found['run_layer_entries']} "
              f"times: {found['run_layer_entries_by_room']}")
        print(f"returns into cli/run.py: {found['returns_into_cli_run']}")
        print(f"stays in run-layer rooms: {found['stays']} over {found['run_layer_events']} events; climbs back up: "
              f"{found['climbs_back_up']} ({found['climbs_in_first_400_events']} in the first 400 events): "
              f"{found['climbs_by_room']}")
        print(f"stays by room: {found['stays_by_room']}")
        print(f"calls against the imports (a lower room calling a higher one): {found['calls_against_imports']}")
        print("  " + "\n  ".join(dict.fromkeys(found["calls_against_imports_list"])))
        print("returns:", ", ".join(found["returns"]))
        print("run-layer entries:\n  " + "\n  ".join(found["run_layer_doors"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
