"""The denoiser cut into pipeline slices (dm_cli.run.ranks.pipeline), in one process: rank 0's slice sends what rank 1's
first block takes, ..., the last slice's output is the whole model's, bit for bit, for every denoiser class the
pipeline runs; the fixed round robin of prompts in flight; the plan's cut read and refused."""

from __future__ import annotations

import copy
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dm_cli.errors import UsageError
from dm_cli.families import call_spec
from dm_cli.families.calls import TensorSpec
from dm_cli.inputs import InputSpec
from dm_cli.model.models import build_model
from dm_cli.model.sources import resolve_source
from dm_cli.run.ranks.pipeline import SliceDone, Turns, cut_to_slice
from dm_cli.run.settle.layout import PIPELINE_CLASSES, Slices, plan_slices

# preset, its denoiser's config changed to have enough blocks to cut three ways, input size
CASES = {
    "tiny-flux": ({"num_layers": 2, "num_single_layers": 2}, InputSpec(32, 48, 1, 1, 3.5, 16)),
    "tiny-flux2": ({"num_layers": 2, "num_single_layers": 2}, InputSpec(32, 32, 1, 1, 4.0, 16)),
    "tiny-qwenimage": ({"num_layers": 4}, InputSpec(32, 32, 1, 1, 4.0, 16)),
    "tiny-wan": ({"num_layers": 4}, InputSpec(32, 32, 1, 1, 5.0, 16, num_frames=5)),
}


def _inputs(spec, generator):
    if isinstance(spec, TensorSpec):
        if spec.kind == "long":
            return torch.zeros(spec.shape, dtype=torch.long)
        if spec.kind == "bool":
            return torch.ones(spec.shape, dtype=torch.bool)
        return torch.randn(spec.shape, generator=generator)
    if isinstance(spec, dict):
        return {k: _inputs(v, generator) for k, v in spec.items()}
    return spec


def _block_keys(model) -> list[str]:
    """The entries of the model's lists of blocks (not the lists inside a block), in order."""
    keys: list[str] = []
    for name, _ in model.named_modules():
        parent, _, index = name.rpartition(".")
        if index.isdigit() and isinstance(model.get_submodule(parent), torch.nn.ModuleList) \
                and not any(name.startswith(key + ".") for key in keys):
            keys.append(name)
    return keys


@pytest.mark.parametrize("preset", sorted(CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_slices_chained_give_the_whole_models_output(preset, world):
    changes, inputs = CASES[preset]
    source = resolve_source(preset)
    comp = next(c for c in source.components if c.name == "transformer")
    comp = replace(comp, config={**comp.config, **changes})
    assert comp.cls in PIPELINE_CLASSES
    torch.manual_seed(0)
    whole = build_model(comp.library, comp.cls, comp.config).eval()
    kwargs = _inputs(call_spec(comp, source.pipeline_class, inputs).kwargs, torch.Generator().manual_seed(1))
    with torch.no_grad():
        kwargs["return_dict"] = False
        expected = whole(**kwargs)[0]
    keys = _block_keys(whole)
    cuts = [round(i * len(keys) / world) for i in range(world + 1)]
    slices = Slices(tuple(tuple(keys[cuts[r]:cuts[r + 1]]) for r in range(world)), in_flight=1)
    wire: list = []
    ranks = []
    for rank in range(world):
        model = copy.deepcopy(whole)
        cut_to_slice(model, slices, rank, wire.append, lambda: wire.pop(0))
        assert len(_block_keys(model)) == len(slices.blocks[rank]) + (rank < world - 1)  # its blocks + SliceEnd
        ranks.append(model)
    with torch.no_grad():
        for model in ranks[:-1]:
            with pytest.raises(SliceDone):
                model(**kwargs)
            assert len(wire) == 1 and all(isinstance(t, torch.Tensor) for t in wire[0])
        out = ranks[-1](**kwargs)[0]
    assert not wire
    assert torch.equal(out, expected)


def test_turns_are_a_fixed_round_robin_that_shrinks_as_prompts_finish():
    """Three prompts in flight, the second finishing first: every rank sees the same order of turns."""
    turns, seen, lock = Turns(3), [], threading.Lock()

    def prompt(slot: int, steps: int) -> None:
        turns.wait(slot)
        for step in range(steps):
            with lock:
                seen.append((slot, step))
            turns.pass_on(slot)
            turns.wait(slot)
        turns.leave(slot)

    threads = [threading.Thread(target=prompt, args=(slot, steps)) for slot, steps in ((0, 3), (1, 1), (2, 2))]
    for thread in reversed(threads):
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]


def test_a_failed_prompt_stops_the_others_waiting():
    turns = Turns(2)
    stopped = []

    def waiting() -> None:
        try:
            turns.wait(1)
        except Exception as error:  # noqa: BLE001
            stopped.append(type(error).__name__)

    thread = threading.Thread(target=waiting)
    thread.start()
    turns.fail(RuntimeError("out of memory"))
    thread.join(10)
    assert stopped == ["_Stopped"]


def _plan(device_map: dict, in_flight=None):
    parallel = SimpleNamespace(in_flight=in_flight) if in_flight else None
    return SimpleNamespace(components={"transformer": SimpleNamespace(device_map=device_map)}, parallel=parallel)


def test_plan_slices_are_the_blocks_on_each_gpu():
    device_map = {"x_embedder": 0, "transformer_blocks.0": 0, "transformer_blocks.1": 0,
                  "single_transformer_blocks.0": 1, "single_transformer_blocks.1": 1, "norm_out": 1, "proj_out": 1}
    slices = plan_slices(_plan(device_map, in_flight=6), "transformer", 2)
    assert slices.blocks == (("transformer_blocks.0", "transformer_blocks.1"),
                             ("single_transformer_blocks.0", "single_transformer_blocks.1"))
    assert slices.in_flight == 6
    assert plan_slices(_plan(device_map), "transformer", 2).in_flight == 2  # one per rank when the plan says none


@pytest.mark.parametrize("device_map, says", [
    ({"": 0}, "whole, not block by block"),
    ({"blocks.0": 0, "blocks.1": 0}, "does not cut"),
    ({"blocks.0": 1, "blocks.1": 0}, "does not cut"),
    ({"blocks.0": 0, "blocks.1": "cpu"}, "puts transformer's blocks on"),
    ({"blocks.0": 0, "blocks.1": 2}, "puts transformer's blocks on"),
])
def test_plans_that_do_not_cut_the_denoiser_per_rank_are_refused(device_map, says):
    with pytest.raises(UsageError, match=says) as refused:
        plan_slices(_plan(device_map), "transformer", 2)
    assert "dmap plan --world-size 2 --parallel pipeline" in str(refused.value)


def test_the_cut_is_the_fastest_that_fits_each_ranks_room():
    """Equal FLOPs, weight-heavy first blocks (FLUX's double blocks): the even cut would overfill rank 0."""
    from dm_cli.planning.parallel.parallel import balanced_cut

    costs, sizes = [1.0] * 6, [3, 3, 1, 1, 1, 1]
    assert balanced_cut(costs, 2) == [0, 3]
    assert balanced_cut(costs, 2, sizes=sizes, room=[6, 10]) == [0, 2]
    assert balanced_cut(costs, 2, sizes=sizes, room=[2, 2]) is None


class _GlooSend:
    """A gloo send as torch.distributed returns it: it reports completion only to wait()."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def is_completed(self) -> bool:
        return False

    def wait(self):
        if self.fail:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        return True


def test_cpu_links_let_each_sent_tensor_go_once_its_send_is_done(monkeypatch):
    """Each tensor a CPU rank sends is released once gloo has sent it, not held until the chunk ends (the first
    rank of the bench held every activation it had sent: +180 MB over 32 image-steps)."""
    import gc
    import time
    import weakref

    import torch.distributed as dist

    from dm_cli.run.ranks.pipeline_links import Links, RankLostError

    monkeypatch.setattr(dist, "isend", lambda tensor, dst: _GlooSend())
    links = Links(torch.device("cpu"))
    sent = [torch.randn(256, 64) for _ in range(20)]
    alive = [weakref.ref(t) for t in sent]
    for tensor in sent:
        links.send([tensor], 1)
    del sent, tensor
    deadline = time.monotonic() + 5
    while any(ref() is not None for ref in alive) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert all(ref() is None for ref in alive), "the sends' tensors were kept after gloo sent them"
    links.flush()

    monkeypatch.setattr(dist, "isend", lambda tensor, dst: _GlooSend(fail=True))  # a lost peer: said at the flush
    links.send([torch.zeros(2)], 1)
    with pytest.raises(RankLostError, match="The pipeline lost another rank"):
        links.flush()
    links.close()  # its thread ends
    deadline = time.monotonic() + 5
    while any(t.name == "dmap-pipeline-sends" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "dmap-pipeline-sends" for t in threading.enumerate())


def test_call_pairs_learn_two_calls_per_step_from_the_first_step():
    """A step's cond and uncond calls share the timestep and the latents: from the second step on, the first of
    them is deferred. A second-order scheduler's repeated timestep (other latents) and one call per step are not
    pairs."""
    from dm_cli.run.ranks.pipeline import CallPairs

    def walk(calls):
        pairs, seen = CallPairs(), []
        for timestep, latents in calls:
            call = (torch.tensor([timestep]), latents)
            if pairs.pairs is None:
                pairs.learn(call)
            seen.append("first" if pairs.deferred else "second" if pairs.second else "alone")
            pairs.calls += 1
        return pairs.pairs, seen

    x0, x1, x2 = (torch.full((1, 4, 8), float(v)) for v in range(3))
    assert walk([(900, x0), (900, x0), (800, x1), (800, x1), (700, x2), (700, x2)]) == (
        True, ["alone", "alone", "first", "second", "first", "second"])
    assert walk([(900, x0), (900, x1), (800, x1), (800, x2)])[0] is False  # Heun: same timestep, new latents
    assert walk([(900, x0), (800, x1), (700, x2)]) == (False, ["alone", "alone", "alone"])
