"""Mutation testing of the planner's search and packing code (`dm_cli/planning/placement/search.py`).

Each mutant is one deliberate behaviour change, written as an exact text replacement in a temporary
copy of the `dm_cli` package; the planner tests, copied beside it, then run in that folder (so the
copy is the `dm_cli` they import). A mutant is *killed* when the tests fail, *survives* when they pass. A replacement that
no longer matches the source exactly once stops the script: the list must follow the code.

    .venv/bin/python scripts/mutation_planner.py              # every mutant, then the score
    .venv/bin/python scripts/mutation_planner.py --list       # names and what each one changes
    .venv/bin/python scripts/mutation_planner.py --only first-fit --only no-skip-fill
    .venv/bin/python scripts/mutation_planner.py --tests tests/planning/test_planner_kernels.py   # one file's kills

Exit status 0 when every mutant is killed, 1 when one survives, 2 when the unmutated tests fail.

Left out as equivalent (same placements; a random differential search of 3,000 cases found no
difference): an unsplittable component placed from any GPU rather than from the fill's cursor (the
best-fit pass over all GPUs and the GPU orders cover it), and auto mode planning staged even when
resident offloads nothing (staged then never offloads less, so resident is kept either way), and
the score ignoring disk bytes (every fill puts blocks on the cpu before disk, and a disk block's
streaming reserve is charged to the cpu: no candidates left to tell apart; 8,000 cases).
Also the cpu as the last resort (`if not ok and offload`): since the refill charges an unchanged
fill's excess until a block moves, the search itself reaches the all-cpu placement (5,000 cases, no
difference); tests/planning/test_planner_search.py still checks that such a component runs on the cpu.
`no-refill-scaling` guards the 16-round limit when an excess is far smaller than the reserve growth
that moves a block; a targeted search (one GPU, four blocks with activations) found the case that
tests/planning/test_planner_search.py now pins.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLANNER = REPO / "dm_cli" / "planning" / "placement" / "search.py"
TESTS = ["tests/planning/test_planner.py", "tests/planning/test_planner_search.py", "tests/planning/test_planner_kernels.py"]

# The fill's test for room on a GPU (`_FillState.room`), which several mutants change.
ROOM = ("total = (self.weights[key] + add_weights + self.reserves.get(key, 0) + max(self.acts[key], add_act)\n"
        "                 + device.overhead)")

# (name, what it changes, exact text in planning/placement/search.py, replacement)
MUTANTS: list[tuple[str, str, str, str]] = [
    # --- the four the issue names -------------------------------------------------------------------
    ("no-skip-fill", "auto never tries the fill that offloads a block missing the last GPU and goes on",
     "for skip in ((False, True) if offload else (False,)):", "for skip in (False,):"),
    ("no-largest-first", "auto fills components in execution order only, never largest first",
     "comp_orders = [exec_order] if len(comps) == 1 else [exec_order, largest_first]",
     "comp_orders = [exec_order]"),
    ("no-gpu-permutations", "auto fills the GPUs in index order only",
     "orders = list(itertools.permutations(gpus)) if len(gpus) <= 4 else [tuple(gpus), tuple(reversed(gpus))]",
     "orders = [tuple(gpus)]"),
    ("first-fit", "a whole component goes to the first GPU with room instead of the one it fills best",
     "device = min(fitting, key=lambda d: state.limits[d.name] - state.weights[d.name])", "device = fitting[0]"),
    # --- the GPU order and the fill styles ----------------------------------------------------------
    ("gpu-order-and-reverse-only", "auto fills the GPUs in index order or its reverse only",
     "orders = list(itertools.permutations(gpus)) if len(gpus) <= 4 else [tuple(gpus), tuple(reversed(gpus))]",
     "orders = [tuple(gpus), tuple(reversed(gpus))]"),
    ("no-prefer-whole", "auto never tries placing each component whole before splitting it",
     "for prefer_whole in (False, True):", "for prefer_whole in (False,):"),
    ("worst-fit", "a whole component goes to the GPU with the most room left",
     "device = min(fitting, key=lambda d: state.limits[d.name] - state.weights[d.name])",
     "device = max(fitting, key=lambda d: state.limits[d.name] - state.weights[d.name])"),
    ("skip-on-every-gpu", "with skip, a block missing any GPU (not only the last) is offloaded",
     "if skip and state.cursor == len(state.gpu_order) - 1:", "if skip:"),
    ("cursor-per-component", "each component's fill starts again at the first GPU",
     "        whole_act = max(comp.activation_peak,",
     "        state.cursor = 0\n        whole_act = max(comp.activation_peak,"),
    # --- room on a device during the fill -----------------------------------------------------------
    ("room-ignores-reserve", "the fill does not count the offload reserve it was given",
     ROOM, ROOM.replace(" + self.reserves.get(key, 0)", "")),
    ("room-ignores-overhead", "the fill does not count the per-GPU overhead",
     ROOM, ROOM.replace("\n                 + device.overhead", "")),
    ("room-ignores-activations", "the fill does not count activations",
     ROOM, ROOM.replace(" + max(self.acts[key], add_act)", "")),
    ("room-sums-activations", "the fill adds activations of blocks that run one after another",
     ROOM, ROOM.replace(" + max(self.acts[key], add_act)", " + self.acts[key] + add_act")),
    ("room-strict", "a block that fills a GPU exactly does not fit",
     "return total <= self.limits[key]", "return total < self.limits[key]"),
    ("offload-ignores-cpu-capacity", "cpu takes any block whatever its capacity (disk never used)",
     "if free is None or free >= nbytes:", "if True:"),
    ("whole-activation-ignored", "a component placed whole is charged its blocks' weights only",
     "whole_act = max(comp.activation_peak, comp.io_bytes, max((b.activation for b in comp.blocks), default=0))",
     "whole_act = 0"),
    ("no-whole-peak-in-fill", "the fill lets a component's last block join the others without its forward's peak",
     "        act = max(act, whole_act)\n", "        pass\n"),
    # --- the fill-and-refill loop -------------------------------------------------------------------
    ("no-refill", "a fill that does not fit is not retried with the reserve it showed",
     "for _ in range(16):", "for _ in range(1):"),
    ("no-refill-scaling", "a refill that leaves the fill unchanged charges the excess once more, no faster",
     "                step = self.grown(reserves, use, times)\n"
     "                following = self.fill(spec, step)\n", ""),
    ("refill-overshoots", "an unchanged fill's excess is charged by the doubling, never bisected back",
     "                high = middle\n", "                low = middle\n"),
    ("refill-ignores-overflow", "a refill charges the streaming reserve but not the rest of an overflow",
     "                want = max(want, reserves.get(key, 0) + (entry.peak - device.capacity) * times)\n",
     "                pass\n"),
    # --- scoring and choosing -----------------------------------------------------------------------
    ("hops-before-offload", "auto minimises hops before offloaded bytes",
     "return (off, disk, hops, round(util, 4))", "return (hops, off, disk, round(util, 4))"),
    ("no-balance-score", "auto does not prefer the plan with the lowest largest share",
     "return (off, disk, hops, round(util, 4))", "return (off, disk, hops, 0)"),
    ("no-balanced-refinement", "auto keeps the greedy fill, never the balanced one",
     "if greedy and greedy[0].score[0] == 0:", "if False:"),
    ("balanced-allows-offload", "the balanced search accepts a fraction at which something is offloaded",
     "if use is not None and self.score(cand.maps, use)[0] == 0:", "if use is not None:"),
    ("worst-plan-chosen", "the residency keeps the worst-scoring candidate",
     "    ok.sort(key=lambda item: item[0])\n", "    ok.sort(key=lambda item: item[0], reverse=True)\n"),
    ("balanced-zero-first-ignored", "balanced_low_0 gives GPU 0 its full share",
     "        limits[zeroed] = 0\n", "        pass\n"),
    # --- exact memory of a placement ----------------------------------------------------------------
    ("fits-strict", "a device filled exactly counts as over capacity",
     "if capacity is not None and entry.peak > capacity:", "if capacity is not None and entry.peak >= capacity:"),
    ("no-reserve", "an offloaded block is not charged to the GPU it streams to",
     "        if offloaded:\n            reserve[str(main)]", "        if False:\n            reserve[str(main)]"),
    ("offloaded-runs-where-stored", "offloaded blocks' activations are charged to cpu/disk, not their GPU",
     "                runs_on = str(main)\n", "                runs_on = key\n"),
    ("activations-add-up", "components loaded together add their activations instead of running in turn",
     "acts[key] = max(acts.get(key, 0), value)", "acts[key] = acts.get(key, 0) + value"),
    ("whole-peak-ignored", "a component on one device is charged its blocks' peaks, not its forward's",
     "comp_acts[only] = max(comp_acts[only], comp.activation_peak, comp.io_bytes)", "pass"),
    ("io-ignored-when-split", "a split component's inputs and outputs are charged nowhere",
     "elif comp.blocks and comp.io_bytes:", "elif False:"),
    ("exec-device-first-entry", "the execution device is the first entry even when it is the cpu",
     "        if devices[str(device)].is_gpu:\n            return device\n    return \"cpu\"",
     "        return device\n    return \"cpu\""),
    ("hops-count-offloaded", "an offloaded block counts as a hop to the cpu",
     "runs = device if devices[str(device)].is_gpu else main", "runs = device"),
    ("offload-not-counted", "bytes on cpu or disk of a split component are not counted as offloaded",
     "        if offloaded(key):\n            off += block.bytes", "        if False:\n            off += block.bytes"),
    # --- resident or staged -------------------------------------------------------------------------
    ("auto-keeps-more-offload", "auto mode keeps the plan that offloads more",
     "if plan is None or other.offloaded_bytes < plan.offloaded_bytes:",
     "if plan is None or other.offloaded_bytes > plan.offloaded_bytes:"),
]


def mutate(source: str, old: str, new: str, name: str) -> str:
    count = source.count(old)
    if count != 1:
        raise SystemExit(f"mutant {name}: its text occurs {count} times in planning/placement/search.py (update the script)")
    return source.replace(old, new)


def run_tests(root: Path, timeout: float, tests: list[str]) -> tuple[bool, str]:
    """Run the planner tests in `root` (which holds dm_cli/ and tests/): (passed, last line)."""
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--hypothesis-seed=0", *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode == 0, (lines[-1] if lines else proc.stderr.strip()[-200:])


def imported_from(root: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", "import dm_cli.planning.placement.search as p; print(p.__file__)"], cwd=root, env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", default=[], help="run only this mutant (repeatable)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per test run (a hang counts as killed)")
    parser.add_argument("--tests", action="append", default=[],
                        help=f"run only this test file (repeatable; default: {', '.join(TESTS)})")
    args = parser.parse_args()
    names = [m[0] for m in MUTANTS]
    unknown = [n for n in args.only if n not in names]
    if unknown:
        print(f"unknown mutant(s): {', '.join(unknown)}; --list shows them", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.only or m[0] in args.only]
    source = PLANNER.read_text()
    mutated = {name: mutate(source, old, new, name) for name, _, old, new in chosen}
    if args.list:
        for name, what, _, _ in chosen:
            print(f"{name:30} {what}")
        return 0

    start = time.perf_counter()
    survivors = []
    with tempfile.TemporaryDirectory(prefix="dmap-mutants-") as tmp:
        root = Path(tmp)
        shutil.copytree(REPO / "dm_cli", root / "dm_cli", ignore=shutil.ignore_patterns("__pycache__"))
        (root / "tests").mkdir()
        tests = args.tests or TESTS
        for name in ["tests/conftest.py", *tests]:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, root / name)
        target = root / "dm_cli" / "planning" / "placement" / "search.py"
        where = imported_from(root)
        if Path(where).resolve() != target.resolve():
            print(f"the tests would import {where}, not the copy", file=sys.stderr)
            return 2
        passed, line = run_tests(root, args.timeout, tests)
        print(f"unmutated planner: {'pass' if passed else 'FAIL'} ({line}, {time.perf_counter() - start:.1f} s)")
        if not passed:
            return 2
        for name, what, _, _ in chosen:
            target.write_text(mutated[name])
            begin = time.perf_counter()
            passed, line = run_tests(root, args.timeout, tests)
            verdict = "SURVIVED" if passed else "killed"
            print(f"{verdict:8} {name:30} {time.perf_counter() - begin:5.1f} s  {line}", flush=True)
            if passed:
                survivors.append(name)
    killed = len(chosen) - len(survivors)
    print(f"\nmutation score: {killed}/{len(chosen)} killed ({100 * killed / len(chosen):.0f}%), "
          f"{time.perf_counter() - start:.0f} s")
    if survivors:
        print("survivors: " + ", ".join(survivors))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
