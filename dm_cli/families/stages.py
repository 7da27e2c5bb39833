"""The stages of a pipeline: which components run together, in which order (encode, denoise, decode).

Plain data, no torch: the planner places per stage, the stage loop runs them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    components: tuple[str, ...]
    # The components run one after another and never together (Wan 2.2's two experts, switched at a
    # boundary step): the planner may load them one at a time, as consecutive sub-stages of this stage.
    exclusive: bool = False


def default_stages(components: list[str], offload_seq: list[str] | None,
                   denoisers: tuple[str, ...] = ("transformer", "unet")) -> list[Stage]:
    """encode (everything before the denoiser), denoise, decode (after it), from model_cpu_offload_seq.

    `denoisers`: component names that denoise (the family's; see dm_cli.families.pipeline_stages).
    Denoisers that follow each other in the sequence (Wan 2.2's `transformer`, `transformer_2`) form one
    denoise stage whose components run one at a time (`exclusive`).
    """
    order = [c for c in (offload_seq or []) if c in components]
    order += [c for c in components if c not in order]
    denoiser_names = denoisers
    denoisers = [c for c in order if c in denoiser_names]
    if not denoisers:
        return [Stage("run", tuple(order))] if order else []
    pivot = order.index(denoisers[0])
    end = pivot + 1
    while end < len(order) and order[end] in denoiser_names:
        end += 1
    extra = [c for c in components if c not in (offload_seq or []) and "controlnet" in c]
    encode = tuple(c for c in order[:pivot] if c not in extra)
    denoise = (*order[pivot:end], *extra)
    decode = tuple(c for c in order[end:] if c not in extra)
    stages = []
    if encode:
        stages.append(Stage("encode", encode))
    stages.append(Stage("denoise", denoise, exclusive=end - pivot > 1))
    if decode:
        stages.append(Stage("decode", decode))
    return stages
