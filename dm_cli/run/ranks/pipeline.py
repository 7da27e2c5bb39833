"""Pipeline parallel under torchrun (`--parallel pipeline`): one slice of the denoiser's blocks per rank, several
prompts' steps in flight at once, so that every rank computes all the time.

A denoiser split over two GPUs in one process runs one GPU at a time. Here rank r holds slice r of the blocks, the
ones the plan puts on GPU r (the same cut points, `plan_slices`), plus the small modules around the blocks (the
embedders and the output layers), and loads nothing of the other slices (`dm_cli.run.load.loading.load_slice`): its
weights as the plan stores them (fp8, int8; a GGUF file, which diffusers reads whole: the other slices' tensors
dropped at once), a LoRA's adapters of its own layers
(`without_blocks`), and of Wan 2.2's two experts its slice of each (both held: see `stage_groups`).

Every rank runs the same diffusers denoising loop for each prompt in flight (the same seeds, the same scheduler
steps); in each denoiser call rank r computes the embedders and its own blocks only:

- rank r > 0 receives the inputs of its first block (every tensor of that block's call) from rank r - 1, in place
  of the ones its own embedders made (`_receive_inputs`, a forward pre-hook);
- rank r < N - 1 sends the inputs of the first block of slice r + 1 and stops its forward there (`SliceEnd`, the
  block that stands for the rest in its block list);
- the last rank finishes the forward and sends the noise prediction to every other rank, which returns it as its
  own forward's output.

The prompts in flight (a chunk of a queue, up to `in_flight` at a time) are threads that take turns in a fixed
round robin (`Turns`), the same on every rank: a prompt holds the turn from receiving its previous prediction,
through the scheduler step, to sending its next activations; then the next prompt computes while the activations
travel. So while rank 1 runs prompt A's second half, rank 0 runs prompt B's first half. Only the thread holding
the turn calls torch.distributed: messages flow in the same order on every rank, which is what pairs them (send
and recv in FIFO order; no tags, which NCCL ignores). Each prompt's steps stay in order and its arithmetic is the
single process's: the images are the same bytes as one process running the same split.

A pipeline that makes two denoiser calls per step (CFG: cond, then uncond) sends both through the slices before it
waits for either prediction: the two branches are two micro-batches, so one prompt with CFG keeps two ranks busy
(`CallPairs`).

Encoding runs once, on rank 0, and the embeddings are broadcast; rank 0 decodes and writes (as `--parallel cfg`).
Without a GPU each rank computes on its CPU, standing for GPU r of the plan.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes.util
import dataclasses
import platform
import threading
import time
from collections import deque

from dm_cli.errors import UsageError
from dm_cli.families.stages import DENOISE
from dm_cli.planning.step_cache import CACHES, diffusers_config, enable, resolved_lite
from dm_cli.run.distributed import TerminateRaises
from dm_cli.run.hooks.adapters import load_loras
from dm_cli.run.hooks.component_hooks import StepCache, fused_loras
from dm_cli.run.hooks.hooks import LoopHook
from dm_cli.run.hooks.step_cache import (
    SliceRelay,
    StepCounter,
    StepCounts,
    drop_states,
    lite_block_hook,
    predicts_next_call,
)
from dm_cli.run.load.loading import load_slice
from dm_cli.run.load.meter import RssSampler
from dm_cli.run.loops.main_rank import MainRankRunners, on_this_rank
from dm_cli.run.loops.stages import StageLoop
from dm_cli.run.ranks.pipeline_links import (
    Links,
    RankThread,
    Turns,
    _Stopped,
    join_all,
)
from dm_cli.run.settle.layout import BLOCK_KEY, Slices, plan_slices

# --- the slice of the denoiser ------------------------------------------------------------------------


class SliceDone(Exception):
    """Raised by `SliceEnd`: this rank's blocks are done for this call."""


def _tensor_leaves(args, kwargs):
    import torch  # lazy: torch (heavy, off start-up)
    from torch.utils._pytree import tree_flatten  # lazy: torch (heavy, off start-up)

    leaves, spec = tree_flatten((args, kwargs))
    return leaves, spec, [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]


def _end_of_slice_class():
    import torch  # lazy: torch (heavy, off start-up)

    class SliceEnd(torch.nn.Module):
        """Stands for the next rank's first block: sends that block's inputs on, then stops this rank's forward."""

        def __init__(self, send):
            super().__init__()
            self._send = send

        def forward(self, *args, **kwargs):
            leaves, _, tensors = _tensor_leaves(args, kwargs)
            self._send([leaves[i] for i in tensors])
            raise SliceDone()

    return SliceEnd


def cut_to_slice(model, slices: Slices, rank: int, send, receive) -> None:
    """Keep rank `rank`'s blocks in the model's block lists (the others are dropped: their weights were never
    read); its first block takes its inputs from `receive()` (rank > 0); a `SliceEnd` calling `send(tensors)`
    stands where the next rank's first block is (rank < N - 1)."""
    import torch  # lazy: torch (heavy, off start-up)

    mine = slices.blocks[rank]
    everything = set(slices.every_block)
    lists: dict[str, list[str]] = {}
    for key in slices.every_block:
        match = BLOCK_KEY.fullmatch(key)
        lists.setdefault(match["list"], []).append(key)
    following = slices.blocks[rank + 1][0] if rank + 1 < slices.world_size else None
    for list_name, keys in lists.items():
        blocks = model.get_submodule(list_name)
        if not isinstance(blocks, torch.nn.ModuleList):
            raise UsageError(f"{type(model).__name__}.{list_name} is not a list of blocks: --parallel pipeline cannot "
                             "cut it.")
        named = {f"{list_name}.{i}": block for i, block in enumerate(blocks)}
        if set(named) != {k for k in everything if k.startswith(list_name + ".")}:
            raise UsageError(f"The plan's blocks of {type(model).__name__}.{list_name} are not the model's "
                             f"{len(named)}: plan again for this model.")
        kept = [named[key] for key in keys if key in mine]
        if following is not None and following in named:
            kept.append(_end_of_slice_class()(send))
        parent, _, leaf = list_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, torch.nn.ModuleList(kept))
    if rank > 0:
        first = model.get_submodule(mine[0].rpartition(".")[0])[0]

        def take_inputs(_module, args, kwargs):
            from torch.utils._pytree import tree_unflatten  # lazy: torch (heavy, off start-up)

            got = receive()
            if got is None:  # nothing sent: a predicted call whose blocks ignore their inputs (SliceForward's lite)
                return None
            leaves, spec, tensors = _tensor_leaves(args, kwargs)
            if len(got) != len(tensors) or any(got[n].shape != leaves[i].shape for n, i in enumerate(tensors)):
                raise RuntimeError("The previous rank sent other inputs than this rank's first block takes: the ranks "
                                   "run different plans or inputs.")
            for n, i in enumerate(tensors):
                leaves[i] = got[n]
            return tree_unflatten(leaves, spec)

        first.register_forward_pre_hook(take_inputs, with_kwargs=True)


@contextlib.contextmanager
def without_blocks(model, keys: frozenset[str]):
    """The blocks named in `keys` (another rank's: their tensors on the meta device) swapped for empty modules at
    the same index while a LoRA loads: peft then patches this rank's layers only, so that the rank holds its slice's
    adapters alone and can fuse them (a meta weight cannot take a merged adapter). The blocks come back after."""
    import torch  # lazy: torch (heavy, off start-up)

    swapped = []
    for key in keys:
        list_name, _, index = key.rpartition(".")
        blocks = model.get_submodule(list_name)
        swapped.append((blocks, int(index), blocks[int(index)]))
        blocks[int(index)] = torch.nn.Module()
    try:
        yield
    finally:
        for blocks, index, block in swapped:
            blocks[index] = block


class CallPairs:
    """One prompt's denoiser calls, for the two CFG branches as micro-batches: a pipeline that makes two calls per
    step (cond, then uncond: Qwen-Image's true CFG, Wan's CFG) sends both calls' activations before it waits for
    either prediction, so that the first rank computes the second branch while the next computes the first.

    Whether a step makes two calls is learned from the first step, run call by call: its second call has the same
    timestep and the same latents as its first (a second-order scheduler's repeated timestep comes with other
    latents, and stays call by call). From then on the first call of each step returns a tensor of the first
    step's prediction shape and dtype, filled in place at the second call (the pipelines read the first prediction
    only after the second call, as CFG-parallel's SeparateCalls relies on too)."""

    def __init__(self):
        self.calls = 0  # calls so far
        self.first = None  # (timestep, latents) of the first call (learning), then of the pending first call
        self.pairs: bool | None = None  # None: not known yet
        self.like = None  # (shape, dtype) of a prediction
        self.pending = None  # the tensor the pending first call returned

    def learn(self, call: tuple) -> None:
        """Called before each call while `pairs` is unknown (the first step runs call by call)."""
        if self.calls == 0:
            self.first = call
        elif self.calls == 1:
            self.pairs = _same_call(call, self.first)

    @property
    def deferred(self) -> bool:
        """Whether the next call is the first of a step's two (its prediction comes with the second's)."""
        return bool(self.pairs) and self.calls % 2 == 0 and self.calls >= 2

    @property
    def second(self) -> bool:
        """Whether the next call is the second of a step's two, after a deferred first."""
        return bool(self.pairs) and self.calls % 2 == 1 and self.calls >= 3


def _call_of(args, kwargs) -> tuple:
    """(timestep, latents) of a denoiser call, as the pipelines pass them (by keyword)."""
    return (kwargs.get("timestep", args[1] if len(args) > 1 else None),
            kwargs.get("hidden_states", args[0] if args else None))


def _same_call(call: tuple, other: tuple) -> bool:
    """Whether two calls denoise the same latents at the same timestep (a step's cond and uncond calls)."""
    import torch  # lazy: torch (heavy, off start-up)

    if any(value is None for value in (*call, *other)):
        return False
    (timestep, latents), (other_timestep, other_latents) = call, other
    timestep, other_timestep = torch.as_tensor(timestep), torch.as_tensor(other_timestep)
    return (timestep.shape == other_timestep.shape and torch.equal(timestep, other_timestep)
            and latents.shape == other_latents.shape and torch.equal(latents, other_latents))


class SliceForward:
    """The denoiser's forward on one rank of the pipeline (see the module's doc and `CallPairs`). `lite`: a block's
    TaylorSeer hook in lite mode (`step_cache.lite_block_hook`): a call it predicts sends no activations on, since
    every block returns zeros and the last rank's `proj_out` predicts alone; each rank reads the same rule at the
    same step, so the ranks skip the same messages."""

    def __init__(self, forward, loop: "PipelineStageLoop", lite=None):
        self.forward, self.loop, self.lite = forward, loop, lite

    def __call__(self, *args, **kwargs):
        import torch  # lazy: torch (heavy, off start-up)

        loop = self.loop
        slot, pairs = loop.local.slot, loop.local.calls
        loop.local.predicted = self.lite is not None and predicts_next_call(self.lite)
        call = _call_of(args, kwargs)
        if pairs.pairs is None:
            pairs.learn(call)
        first, second = pairs.deferred, pairs.second
        if second and not _same_call(call, pairs.first):
            raise RuntimeError("The pipeline expected the second (uncond) call of a step and got another step's call: "
                               "this pipeline does not make two calls every step.")
        if first:
            pairs.first = call
            loop.paired_steps += 1
        pairs.calls += 1
        if loop.is_last:
            out = self.forward(*args, **kwargs)
            prediction = (out[0] if isinstance(out, tuple) else out.sample).detach().clone()
            pairs.like = (prediction.shape, prediction.dtype)
            for rank in range(loop.world_size - 1):
                loop.links.send([prediction], rank)
            if not first:  # the turn passes once both calls of a pair have sent
                loop.turns.pass_on(slot)
                loop.turns.wait(slot)
            return out
        try:
            self.forward(*args, **kwargs)
        except SliceDone:
            pass
        else:
            raise RuntimeError("A pipeline slice ran past its last block: the model's forward skipped SliceEnd.")
        if first:
            shape, dtype = pairs.like
            pairs.pending = torch.empty(shape, dtype=dtype, device=loop.rank_device)
            prediction = pairs.pending
        else:
            loop.turns.pass_on(slot)
            loop.turns.wait(slot)
            if second:
                (earlier,) = loop.links.recv(loop.world_size - 1)
                if earlier.shape != pairs.pending.shape or earlier.dtype != pairs.pending.dtype:
                    raise RuntimeError("The first call of a step predicted another shape or dtype than the first "
                                       "step's: the pipeline's calls differ from step to step.")
                pairs.pending.copy_(earlier)
                pairs.pending = None
            (prediction,) = loop.links.recv(loop.world_size - 1)
            pairs.like = (prediction.shape, prediction.dtype)
        if not kwargs.get("return_dict", True):
            return (prediction,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput  # lazy: diffusers (heavy, off start-up)

        return Transformer2DModelOutput(sample=prediction)


# --- the stage loop -------------------------------------------------------------------------------------


def _one_malloc_arena() -> None:
    """On CPU ranks the prompts in flight are threads, and glibc's malloc gives each thread its own arena, each
    keeping what its prompt freed. One arena for all (scripts/bench_parallel.py, 4 steps of 8 prompts: the first
    rank's peak +548 MB instead of +703 MB). A fixed small mmap threshold held less again (+484 MB) but made every
    activation a fresh mapping, page faults and all: each rank computed 20% slower, so it is not set. GPUs allocate
    through CUDA's caching allocator and are not concerned; other C libraries are left as they are."""
    name = ctypes.util.find_library("c")
    if not name or platform.libc_ver()[0] != "glibc":
        return
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-8, 1)  # M_ARENA_MAX


class PipelineStageLoop(StageLoop):
    """The stage loop of one rank of the pipeline: rank 0 encodes (embeddings broadcast), decodes and writes; every
    rank holds its slice of the denoiser and denoises the prompts of a chunk together, taking turns."""

    def __init__(self, *args, sharing, notices: list | None = None, **kwargs):
        import torch  # lazy: torch (heavy, off start-up)
        import torch.distributed as dist  # lazy: torch (heavy, off start-up)

        super().__init__(*args, **kwargs)
        self.sharing = sharing
        self.notices = notices if notices is not None else []
        self.paired_steps = 0  # steps whose two CFG calls travelled as micro-batches (CallPairs)
        ranks = sharing.ranks
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.is_last = self.rank == self.world_size - 1
        self.denoisers = {self.family.denoiser, *self.family.experts}
        self.slices = plan_slices(self.plan, self.family.denoiser, self.world_size)
        self.owns_group = not dist.is_initialized()  # a queue or a script that joined first keeps its group
        ranks.join("cpu:gloo,cuda:nccl" if self.cuda else "gloo")
        if self.cuda:
            torch.cuda.set_device(ranks.local_rank % torch.cuda.device_count())
        self.rank_device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        if not self.cuda:
            _one_malloc_arena()
        self.links = Links(self.rank_device)
        self.local = threading.local()
        self.turns = Turns(0)
        self._terminate = TerminateRaises().__enter__()  # SIGTERM stops this rank as Ctrl-C does, in order (close)
        self.hooks.replace_hook("step_cache", SliceStepCache(self))
        self.hooks.register_hook(SliceEnds(self), "slice_end", after="step_cache")

    # --- where things go --------------------------------------------------------------------------

    @property
    def pipe(self):
        shell = getattr(self.local, "pipe", None)
        return shell if shell is not None else StageLoop.pipe.fget(self)

    def device_map(self, name: str) -> dict:
        """The denoiser's slice on this rank's device; everything else as planned (on the CPU without GPUs)."""
        if name in self.denoisers:
            return {"": str(self.rank_device) if self.cuda else "cpu"}
        return on_this_rank(super().device_map(name), self.cuda, self.simulate)

    def stage_runners(self) -> PipelineRunners:
        return PipelineRunners(self)

    def load_stage(self, names: list[str], stage=None) -> None:
        mine = [n for n in names if self.sharing.is_main or n in self.denoisers]
        for name in mine:
            if name in self.denoisers and name not in self.loaded:
                self._load_slice(name)
        super().load_stage([n for n in mine if n not in self.denoisers], stage)

    def _load_slice(self, name: str) -> None:
        slices = plan_slices(self.plan, name, self.world_size)  # Wan 2.2's experts: each cut as the plan cuts it
        others = frozenset(slices.every_block) - set(slices.blocks[self.rank])
        self.status(f"Loading slice {self.rank + 1} of {self.world_size} of {name} ({self.rank_device})…")
        model = load_slice(self.components[name], str(self.rank_device), self.plan.dtype, others,
                           self.plan.weights.get(name))
        patching = [lora for lora in self.loras if lora.component == name]
        if patching:  # before the cut: the LoRA's keys name the blocks by their index in the whole model
            self.status(f"Loading {len(patching)} LoRA(s) into slice {self.rank + 1} of {name}…")
            with without_blocks(model, others):
                load_loras(self.pipe, name, model, patching, self.torch_dtype, fuse=name in fused_loras(self.plan))
        self.hooks.apply(name, model, only=SLICE_HOOKS)
        cache = self.plan.cache
        lite = cache is not None and cache.name == "taylorseer" and resolved_lite(cache, self.family)
        model.forward = SliceForward(model.forward, self, lite_block_hook(model) if lite else None)
        self.loaded[name] = model
        if self._pipe is not None:
            setattr(self._pipe, name, model)
        self.status(None)

    # --- running ------------------------------------------------------------------------------------

    def runs_together(self, stage_plan) -> bool:
        return stage_plan.kind == DENOISE

    def stage_groups(self) -> list[list]:
        """Wan 2.2's experts, planned one at a time, run as one stage holding both slices: the prompts in flight
        may stand on either side of the boundary step, and each switches on every rank at the same step (the same
        diffusers loop, the same timesteps)."""
        groups = []
        for group in super().stage_groups():
            if len(group) > 1:
                names = [name for part in group for name in part.components]
                use = {}  # per device, the sub-stage using it most
                for part in group:
                    for device, each in part.use.items():
                        if device not in use or each.peak > use[device].peak:
                            use[device] = each
                group = [dataclasses.replace(group[0], components=names, use=use, note="")]
            groups.append(group)
        return groups

    def run_stage_together(self, stage_plan, jobs: list, carries: list, on_step, stage) -> None:
        """Denoise every job of the chunk, up to `in_flight` at a time, taking turns (see the module's doc)."""
        missing = [value for value in stage_plan.consumes if not all(c.has(value) for c in carries)]
        if missing:
            raise UsageError(f"The plan runs {stage_plan.name} before the stage that makes its {missing[0]}: the "
                             "stages are out of order.")
        self.hooks["meter"].reset_peaks()
        self.meter.current[:] = [str(self.rank_device) if self.cuda else "cpu"]
        sampled = self.measure and not self.cuda
        stage.tracked = "process peak RSS" if sampled else ("none (CUDA: max_memory_allocated)" if self.measure
                                                             else "not measured")
        start = time.perf_counter()
        with RssSampler() if sampled else contextlib.nullcontext() as rss:
            self._denoise_in_flight(stage_plan, jobs, carries, on_step)
        stage.run_s = time.perf_counter() - start
        self.hooks["meter"].measured(stage, rss)

    def _denoise_in_flight(self, stage_plan, jobs: list, carries: list, on_step) -> None:
        base = StageLoop.pipe.fget(self)
        slots = min(self.slices.in_flight, len(jobs))
        self.turns = turns = Turns(slots)
        waiting = deque(range(len(jobs)))
        errors: list[BaseException] = []

        def work(slot: int) -> None:
            self.local.slot = slot
            try:
                turns.wait(slot)
                while waiting:
                    n = waiting.popleft()
                    shell = copy.copy(base)  # its own scheduler (its step index), the same components
                    object.__setattr__(shell, "scheduler", copy.deepcopy(base.scheduler))
                    self.local.pipe, self.local.calls = shell, CallPairs()
                    self.runners.run_denoise(stage_plan, jobs[n], carries[n], on_step)
                turns.leave(slot)
            except _Stopped:
                pass
            except BaseException as error:  # noqa: BLE001 - handed to the calling thread
                errors.append(error)
                turns.fail(error)
            finally:
                self.local.pipe = None

        threads = [RankThread(work, (slot,), f"dmap-pipeline-{slot}") for slot in range(slots)]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while not thread.finished.wait(0.5):  # not join(): see RankThread
                    pass
        except BaseException as error:  # Ctrl-C or SIGTERM in the calling thread: stop the prompts in flight, in order
            turns.fail(error)
            join_all(threads)  # each ends at its next turn: none is left running when the process exits
            raise
        if errors:
            raise errors[0]
        self.links.flush()
        said = "micro-batches"
        if self.paired_steps and not any(said in notice for notice in self.notices):
            self.notices.append("Each step's two CFG calls (cond, uncond) ran as two micro-batches through the slices "
                                f"({self.paired_steps} steps so far, the first step of each prompt call by call).")

    def close(self) -> None:
        """The sends finished, the send thread stopped, the models freed, then the process group left (if this loop
        joined it): in this order on every exit, so that nothing of gloo still runs when the process ends."""
        try:
            self.links.flush()
        finally:
            try:
                self.links.close()
                super().close()
                if self.owns_group:
                    self.sharing.ranks.leave()
            finally:
                self._terminate.__exit__(None, None, None)



class PipelineRunners(MainRankRunners):
    """The stage runners of a pipeline rank: rank 0's encode and decode (MainRankRunners); a denoise only from
    `run_stage_together`'s threads, each with its own pipeline shell."""

    def denoise(self, names, job, embeds, on_step, switch=None, image_latents=None, whole: bool = False):
        if getattr(self.loop.local, "pipe", None) is None:
            raise RuntimeError("A pipeline rank denoises through run_stage_together only.")
        return super().denoise(names, job, embeds, on_step, switch, image_latents, whole)

# --- the hooks of a slice (dm_cli.run.hooks.hooks) -------------------------------------------------------------------

SLICE_HOOKS = ("step_cache", "slice_end", "meter")  # what a rank puts on its slice of the denoiser, in this order


class SliceStepCache(StepCache):
    """--cache on this rank's slice: diffusers' hooks put on the whole model before the cut (its first and last
    blocks are the model's; none lands on SliceEnd), so each kept block keeps its hook and its state lives on
    this rank. fbc and magcache: a SliceRelay carries the decision and the first block's tensors with the
    activations (dm_cli.run.hooks.step_cache). Every hook state is a prompt in flight's: its cache contexts are named
    after its slot (`cache_context`), and only its own are reset (`reset`)."""

    def __init__(self, loop: PipelineStageLoop):
        super().__init__(loop)
        self.loop = loop
        self.relays: dict = {}  # denoiser -> its slice's SliceRelay (fbc, magcache) or None (taylorseer)

    def apply(self, name: str, model) -> None:
        if not self.cached(name):
            return

        from diffusers.hooks.hooks import CacheContext  # lazy: diffusers (heavy, off start-up)

        loop, cache = self.loop, self.plan.cache
        enable(model, cache, self.family, None, self.plan.dtype)
        relay = SliceRelay(model, cache, loop.rank, loop.world_size) if CACHES[cache.name].head_and_tail else None
        self.relays[name] = relay
        own = model.cache_context

        @contextlib.contextmanager
        def cache_context(context: str, **kwargs):
            config = getattr(loop.local, "cache_config", None)
            if relay is not None and config is not None:
                relay.use_config(config)
            slot = getattr(loop.local, "slot", None)
            with own(context if slot is None else f"{slot}:{context}", **kwargs):
                if relay is None:
                    yield
                    return
                # diffusers sets the shared state's context through the first block's hook, which the other ranks lack
                relay.manager.set_context(CacheContext(context if slot is None else f"{slot}:{context}", **kwargs))
                try:
                    yield
                finally:
                    relay.manager.set_context(None)

        model.cache_context = cache_context
        # the diffusers pipeline resets the hooks at the end of its call (maybe_free_model_hooks): this prompt's only
        model._reset_stateful_cache = lambda recurse=True: drop_states(model, f"{getattr(loop.local, 'slot', None)}:")

    def count(self, name: str, model) -> None:
        """The counter of the slice's calls (after the cut: its probe is a kept module); fbc's and magcache's
        computed calls counted by the relay, from the decision every rank shares."""
        if name not in self.relays:
            return

        relay = self.relays[name]
        model._diffusers_hook.invalidate_child_registries_cache()  # the dropped blocks' hooks are gone
        counter = StepCounter(model, self.plan.cache, probe=relay is None)
        counter.counts = self.counts.setdefault(name, StepCounts())
        if relay is not None:
            relay.counter = counter
        self.counters[name] = counter

    def reset(self, job=None) -> None:
        """This prompt's hook states emptied (the other prompts in flight keep theirs); magcache made for its steps."""
        loop = self.loop
        slot = getattr(loop.local, "slot", None)
        for counter in self.counters.values():
            drop_states(counter.model, f"{slot}:")
        if job is not None and self.plan.cache is not None and self.plan.cache.name == "magcache":
            loop.local.cache_config = diffusers_config(self.plan.cache, self.family, job.steps, self.plan.dtype)


class SliceEnds(LoopHook):
    """The slice's ends (`cut_to_slice`): the other ranks' blocks dropped, the first block fed by the previous rank,
    a SliceEnd sending on to the next; the slice's step cache relay in between, then its counter (after the cut)."""

    def __init__(self, loop: PipelineStageLoop):
        self.loop = loop

    def apply(self, name: str, model) -> None:
        loop = self.loop
        if name not in loop.denoisers:
            return
        cache = loop.hooks["step_cache"]
        relay = cache.relays.get(name)
        slices = plan_slices(loop.plan, name, loop.world_size)  # Wan 2.2's experts: each cut as the plan cuts it
        def send(tensors: list) -> None:
            if not getattr(loop.local, "predicted", False):  # a lite TaylorSeer's predicted call: no hop
                loop.links.send(relay.outgoing(tensors) if relay else tensors, loop.rank + 1)

        def receive() -> list | None:
            if getattr(loop.local, "predicted", False):
                return None
            got = loop.links.recv(loop.rank - 1)
            return relay.incoming(got) if relay else got

        cut_to_slice(model, slices, loop.rank, send, receive)
        cache.count(name, model)
