"""Parallel within a step under torchrun: CFG-parallel and context parallel (Ulysses) for one image at a time.

`dmap run --parallel cfg|context|cfg+context|auto` (or a plan file's `parallel`, dm_cli.planning.parallel.parallel) under
`torchrun --nproc-per-node N`: every rank runs the same denoising loop on the same latents (same seed), and the
ranks share the work inside each denoiser call.

- **cfg** (2 ranks per image): the two guidance branches on two ranks. A doubled batch ([uncond, cond] in one
  call: SD, SDXL, SD3, Z-Image, LTX-2): rank b of the pair runs half b of every batched input and the halves
  of the output are all-gathered (`BatchHalves`). Two separate calls per step (Qwen-Image's true CFG, Wan's
  cond and uncond calls): branch 0 runs the first (cond) call, branch 1 the second (uncond); branch 1 answers
  the first call with an empty tensor that it fills in place at the second call, after the exchange
  (`SeparateCalls`: both pipelines only hold the first call's output between the two calls).
- **context** (Ulysses degree u): diffusers' `ContextParallelConfig(ulysses_degree=u)` through
  `enable_parallelism` on denoisers with a `_cp_plan`: the sequence is split over the ranks, attention heads
  exchanged all-to-all, the output gathered inside the model's forward.
- **cfg+context**: ranks r and r+u form a CFG pair, ranks of one branch a Ulysses group (a (cfg, ring, ulysses)
  device mesh).

The text encoders run once, on rank 0 (as the plan places them), and their embeddings are broadcast to the
other ranks: a second copy of a large encoder per rank is what users ask to avoid, and encoding is a small part
of a step-bound run. The VAE decodes once, on rank 0, which writes the outputs; the other ranks load only the
denoiser (whole, on GPU r under CUDA) and return no images.

On a machine without an accelerator diffusers' `_resolve_parallel_config` cannot run: it picks the rank's
device as `rank % torch.accelerator.device_count()`, a ZeroDivisionError with no accelerator. `enable_context`
then builds the same `ParallelConfig` with the CPU as the device (everything else, the all-to-all over gloo
included, is diffusers' own).
"""

from __future__ import annotations

from dm_cli.errors import UsageError
from dm_cli.planning.parallel.parallel import (
    guidance_branches,
)
from dm_cli.run.hooks.component_hooks import StepCache
from dm_cli.run.hooks.step_cache import agree_across
from dm_cli.run.loops.main_rank import MainRankRunners, on_this_rank
from dm_cli.run.loops.stages import StageLoop
from dm_cli.run.request import run_inputs
from dm_cli.run.settle.layout import StepSharing


def check_job(sharing: StepSharing, family, job) -> None:
    """A job (a generate() call may change guidance) must still have two guidance branches under cfg."""
    if sharing.cfg != 2:
        return

    guidance = guidance_branches(family, run_inputs(job.generation), job.negative_prompt, dict(job.settings))
    if guidance.branches != 2:
        raise UsageError(guidance.why_not)


# --- the process group and the mesh ------------------------------------------------------------------------


def join(sharing: StepSharing, cuda: bool):
    """Join the group (gloo for objects; NCCL for tensors on GPUs) and build the (cfg, ring, ulysses) mesh:
    (mesh, the CFG pair's group, whether this call joined)."""
    import torch  # lazy: torch (heavy, off start-up)
    import torch.distributed as dist  # lazy: torch (heavy, off start-up)
    from torch.distributed.device_mesh import init_device_mesh  # lazy: torch (heavy, off start-up)

    owner = not dist.is_initialized()  # a script that joined first keeps its group after the session
    sharing.ranks.join("cpu:gloo,cuda:nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(sharing.ranks.local_rank % torch.cuda.device_count())
    mesh = init_device_mesh("cuda" if cuda else "cpu", (sharing.cfg, 1, sharing.ulysses),
                            mesh_dim_names=("cfg", "ring", "ulysses"))
    return mesh, (mesh["cfg"].get_group() if sharing.cfg == 2 else dist.group.WORLD), owner


def _gather(tensor, group):
    """Every member's `tensor` of `group`, in rank order."""
    import torch  # lazy: torch (heavy, off start-up)
    import torch.distributed as dist  # lazy: torch (heavy, off start-up)

    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


# --- CFG-parallel: the two shapes of guidance -------------------------------------------------------------


def _main_input(args, kwargs):
    for key in ("hidden_states", "sample", "x"):
        if key in kwargs:
            return kwargs[key]
    return args[0] if args else None


def _batch_of(value) -> int | None:
    if isinstance(value, (list, tuple)):
        return len(value)
    return value.shape[0] if getattr(value, "dim", lambda: 0)() > 0 else None


def _half(value, batch: int, branch: int):
    """`value`'s half for `branch` when it is batched (first dimension or length `batch`), else itself."""
    import torch  # lazy: torch (heavy, off start-up)

    size = batch // 2
    if isinstance(value, torch.Tensor):
        return value[branch * size:(branch + 1) * size] if value.dim() > 0 and value.shape[0] == batch else value
    if isinstance(value, (list, tuple)) and len(value) == batch and all(isinstance(v, torch.Tensor) for v in value):
        return type(value)(value[branch * size:(branch + 1) * size])
    if isinstance(value, dict):
        return {k: _half(v, batch, branch) for k, v in value.items()}
    return value


def _joined(value, half: int, group):
    """The all-gathered halves of an output value (a batched tensor, or a list of per-sample tensors)."""
    import torch  # lazy: torch (heavy, off start-up)

    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == half:
        return torch.cat(_gather(value, group), dim=0)
    if isinstance(value, list) and len(value) == half and all(isinstance(v, torch.Tensor) for v in value):
        return [t for part in _gather(torch.stack(value), group) for t in part.unbind(0)]
    return value


class BatchHalves:
    """A denoiser forward that runs this rank's half of a CFG-doubled batch and all-gathers the outputs."""

    def __init__(self, forward, branch: int, group):
        self.forward, self.branch, self.group = forward, branch, group

    def __call__(self, *args, **kwargs):
        batch = _batch_of(_main_input(args, kwargs))
        if batch is None or batch % 2:  # not a doubled batch (guidance off for this call): every rank runs it
            return self.forward(*args, **kwargs)
        out = self.forward(*[_half(a, batch, self.branch) for a in args],
                           **{k: _half(v, batch, self.branch) for k, v in kwargs.items()})
        if isinstance(out, tuple):
            return tuple(_joined(v, batch // 2, self.group) for v in out)
        for key in list(out.keys()):  # a diffusers BaseOutput
            out[key] = _joined(out[key], batch // 2, self.group)
        return out


class SeparateCalls:
    """Two denoiser calls per step (cond, then uncond) shared by a CFG pair: branch 0 runs the first, branch 1
    the second. Branch 1 answers the first call with an empty tensor and fills it in place at the second call,
    after the exchange; branch 0 answers the second call with branch 1's output. One object for every expert
    (Wan 2.2): a step's two calls go to the same one."""

    def __init__(self, branch: int, group):
        self.branch, self.group = branch, group
        self.reset()

    def reset(self) -> None:
        self.calls, self.first, self.timestep = 0, None, None

    def wrap(self, forward, dtype):
        def call(*args, **kwargs):
            return self._call(forward, dtype, args, kwargs)
        return call

    def _call(self, forward, dtype, args, kwargs):
        import torch  # lazy: torch (heavy, off start-up)

        if kwargs.get("return_dict", True):
            raise RuntimeError("CFG-parallel over separate calls needs the pipeline's return_dict=False calls.")
        timestep = kwargs.get("timestep")
        if self.calls == 0:
            self.calls, self.timestep = 1, timestep
            if self.branch == 0:
                out = forward(*args, **kwargs)
                self.first = out[0]
                return out
            self.first = torch.empty(0, dtype=dtype, device=_main_input(args, kwargs).device)
            return (self.first,)
        if timestep is not None and self.timestep is not None and not torch.equal(timestep, self.timestep):
            raise RuntimeError("CFG-parallel expected the second (uncond) call of a step and got another step's "
                               "call: this pipeline does not make two calls every step.")
        mine = self.first if self.branch == 0 else forward(*args, **kwargs)[0]
        cond, uncond = _gather(mine, self.group)
        if self.branch == 1:
            if cond.dtype != self.first.dtype:
                raise RuntimeError(f"The denoiser returned {cond.dtype}, not its weights' {self.first.dtype}.")
            self.first.resize_(cond.shape).copy_(cond)
        self.reset()
        return (uncond if self.branch == 0 else mine,)


# --- context parallel -----------------------------------------------------------------------------------


def enable_context(model, sharing: StepSharing, mesh, cuda: bool) -> None:
    """diffusers' Ulysses context parallel on `model` over this rank's Ulysses group of `mesh`."""
    from diffusers import ContextParallelConfig  # lazy: diffusers (heavy, off start-up)

    if not getattr(model, "_cp_plan", None):
        raise UsageError(f"{type(model).__name__} has no _cp_plan in this diffusers, so it cannot run context "
                         "parallel: use --parallel cfg.")
    config = ContextParallelConfig(ulysses_degree=sharing.ulysses, mesh=mesh["ring", "ulysses"])
    if not cuda:
        model._resolve_parallel_config = lambda given: _cpu_parallel_config(model, given, sharing)
    model.enable_parallelism(config=config)


def _cpu_parallel_config(model, config, sharing: StepSharing):
    """diffusers' `_resolve_parallel_config` with the CPU as the device (see the module's doc)."""
    import torch  # lazy: torch (heavy, off start-up)
    from diffusers.models._modeling_parallel import ParallelConfig  # lazy: diffusers (heavy, off start-up)

    config = ParallelConfig(context_parallel_config=config)
    config.setup(sharing.ranks.rank, sharing.ranks.world_size, torch.device("cpu"),
                 mesh=config.context_parallel_config.mesh)
    model._parallel_config = config
    return config


# --- the stage loop ------------------------------------------------------------------------------------


class ParallelStageLoop(StageLoop):
    """The stage loop of one rank of a shared step: encoders and VAE on rank 0 only (embeddings broadcast,
    images decoded once), the denoiser whole on every rank with CFG-parallel and/or context parallel."""

    def __init__(self, *args, sharing: StepSharing, **kwargs):
        super().__init__(*args, **kwargs)
        self.sharing = sharing
        self.denoisers = {self.family.denoiser, *self.family.experts}
        self.mesh, self.cfg_group, self.owns_group = join(sharing, self.cuda)
        self.separate = SeparateCalls(sharing.branch, self.cfg_group) if sharing.guidance == "separate" else None
        self.hooks.replace_hook("step_cache", AgreedStepCache(self))

    def device_map(self, name: str) -> dict:
        """The denoiser whole on this rank's GPU (rank r on GPU r); everything else as planned."""
        if name in self.denoisers and self.cuda:
            import torch  # lazy: torch (heavy, off start-up)

            return {"": torch.cuda.current_device()}
        return on_this_rank(super().device_map(name), self.cuda, self.simulate)

    def stage_runners(self) -> ParallelRunners:
        return ParallelRunners(self)

    def load_stage(self, names: list[str], stage=None) -> None:
        mine = [n for n in names if self.sharing.is_main or n in self.denoisers]
        fresh = [n for n in mine if n not in self.loaded]
        super().load_stage(mine, stage)
        for name in fresh:
            if name in self.denoisers:
                self._share(self.loaded[name])

    def _share(self, model) -> None:
        if self.sharing.ulysses > 1:
            enable_context(model, self.sharing, self.mesh, self.cuda)
        if self.sharing.cfg == 2:
            # what the denoiser computes in: the plan's dtype (fp8/int8/GGUF weights are stored in another)
            dtype = self.torch_dtype or next(model.parameters()).dtype
            model.forward = (self.separate.wrap(model.forward, dtype) if self.separate is not None
                             else BatchHalves(model.forward, self.sharing.branch, self.cfg_group))

    def sharing_group(self):
        """The ranks whose parts make one process's denoiser call: the Ulysses group, with its CFG pair when the
        pair halves a doubled batch (separate calls are separate cache contexts); None when a rank's call is whole."""
        import torch.distributed as dist  # lazy: torch (heavy, off start-up)

        if self.sharing.cfg == 2 and self.separate is None:
            return dist.group.WORLD
        return self.mesh["ulysses"].get_group() if self.sharing.ulysses > 1 else None

    def _pair_counts(self, before: dict) -> None:
        """--cache under separate CFG calls: each rank computes one branch's calls, so the pair's computed calls are
        summed (every rank counts every call), as one process counts both branches."""
        import torch  # lazy: torch (heavy, off start-up)
        import torch.distributed as dist  # lazy: torch (heavy, off start-up)

        names = sorted(self.step_counts)
        done = torch.tensor([self.step_counts[n].computed - before.get(n, 0) for n in names],
                            device="cuda" if self.cuda else "cpu")
        dist.all_reduce(done, group=self.cfg_group)
        for name, count in zip(names, done.tolist()):
            self.step_counts[name].computed = before.get(name, 0) + int(count)

    def close(self) -> None:
        super().close()
        if self.owns_group:
            self.sharing.ranks.leave()


class ParallelRunners(MainRankRunners):
    """The stage runners of a rank sharing each step: rank 0's encode and decode (MainRankRunners); a denoise checked
    against the sharing, its separate CFG calls paired and their computed calls summed over the pair."""

    def denoise(self, names, job, embeds, on_step, switch=None, image_latents=None, whole: bool = False):
        loop = self.loop
        check_job(loop.sharing, loop.family, job)
        if loop.separate is not None:
            loop.separate.reset()
        computed = {name: counts.computed for name, counts in loop.step_counts.items()}
        out = super().denoise(names, job, embeds, on_step, switch, image_latents, whole)
        if loop.separate is not None and loop.separate.calls:
            raise RuntimeError("CFG-parallel over separate calls ended a denoise between a step's two calls.")
        if loop.separate is not None and loop.step_counts:
            loop._pair_counts(computed)
        return out


class AgreedStepCache(StepCache):
    """The step cache as one process applies it; fbc's skip decision then made over the ranks that share a call
    (dm_cli.run.hooks.step_cache.agree_across). TaylorSeer and MagCache decide by the step's index alone, and under
    separate CFG calls each rank's branch is its own cache context, as in one process."""

    def __init__(self, loop: ParallelStageLoop):
        super().__init__(loop)
        self.loop = loop

    def enable(self, name: str, model, steps: int | None) -> None:
        super().enable(name, model, steps)
        group = self.loop.sharing_group()
        if self.plan.cache is not None and self.plan.cache.name == "fbc" and group is not None:
            agree_across(model, group)
