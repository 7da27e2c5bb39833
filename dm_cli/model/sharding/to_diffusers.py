"""`dmap shard --to-diffusers`: a single file's tensors, renamed by diffusers' mapping, as the tensors the shard
writer writes: byte ranges of the file where a tensor is one, GGUF quantized tensors read and dequantized when
written, what the mapping computed held in memory; and the check that they are what the config builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dm_cli.errors import CheckpointError, SourceError
from dm_cli.model.sharding.layout import CONVERTIBLE, PlannedTensor, SourceTensor
from dm_cli.model.skeleton import load_skeleton


@dataclass(frozen=True)
class _QuantizedRange:
    """A GGUF quantized tensor as a byte range of its file (read when the writer gets to it, never mapped)."""

    path: Path
    begin: int
    end: int
    shape: tuple[int, ...]  # rows x bytes of blocks, as diffusers' GGUFParameter holds it
    quant_type: int


class _Dequantized(dict):
    """The writer's in-memory tensors (what `writing._tensor_bytes` reads by name) for --to-diffusers: a GGUF quantized
    tensor is read (one bounded read) and dequantized with diffusers' own `dequantize_gguf_tensor` only when the
    writer asks for it."""

    def __getitem__(self, name):
        tensor = super().__getitem__(name)
        if isinstance(tensor, _QuantizedRange):
            # torch and diffusers: imported on use, so start-up stays free of torch
            import torch
            from diffusers.quantizers.gguf.utils import GGUFParameter

            with open(tensor.path, "rb") as handle:
                handle.seek(tensor.begin)
                raw = bytearray(handle.read(tensor.end - tensor.begin))
            if len(raw) != tensor.end - tensor.begin:
                raise CheckpointError(f"{tensor.path.name} ended before tensor '{name}': it changed while dmap read it.")
            data = torch.frombuffer(raw, dtype=torch.uint8).reshape(tensor.shape)
            tensor = GGUFParameter(data, quant_type=tensor.quant_type)
        if getattr(tensor, "quant_type", None) is None:
            return tensor
        # diffusers: imported on use, so start-up stays free of torch
        from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

        return dequantize_gguf_tensor(tensor)


def converted_tensors(converted, target: str | None) -> tuple[list[PlannedTensor], dict, int]:
    """(the writer's tensors, those it reads from memory by name, how many change dtype or are dequantized): a
    contiguous view of the file is a byte range (copied, or converted after a bounded read), a quantized tensor a
    range read and dequantized when written, what the mapping computed (a concatenation) a tensor in memory."""
    path = converted.path
    in_memory = _Dequantized()
    planned: list[PlannedTensor] = []
    changed = 0
    for name, tensor in converted.tensors.items():
        quantized = getattr(tensor, "quant_type", None) is not None
        stored = "float32" if quantized else str(tensor.dtype).removeprefix("torch.")
        shape = _logical_shape(tensor) if quantized else tuple(tensor.shape)
        span = converted.file_range(tensor.as_tensor() if quantized else tensor)
        if span is not None and not quantized:
            source = SourceTensor(name, stored, shape, path, span[0], span[1])
        else:  # quantized, or computed by the mapping (a concatenation): one tensor at a time, in memory
            in_memory[name] = tensor if span is None else _QuantizedRange(path, *span, tuple(tensor.shape),
                                                                          int(tensor.quant_type))
            source = SourceTensor(name, stored, shape, path, legacy=True)
        out = stored
        if converted.kept_in_fp32(name) and (quantized or stored in CONVERTIBLE):
            out = "float32" if quantized else stored
        elif target is not None and (quantized or stored in CONVERTIBLE):
            out = target
        changed += quantized or out != stored
        planned.append(PlannedTensor(source, out))
    return planned, in_memory, changed


def to_diffusers_notes(converted, planned: list[PlannedTensor], comp, where: str, target: str | None) -> list[str]:
    notes = [f"config.json: the {comp.cls} config of '{comp.name}' from {where}."]
    quantized = sum(getattr(t, "quant_type", None) is not None for t in converted.tensors.values())
    kept = sum(converted.kept_in_fp32(t.name) for t in planned)
    if quantized:
        notes.append(f"{quantized} GGUF tensor(s) dequantized (diffusers' dequantize_gguf_tensor) to {target}"
                     + (f"; {kept} tensor(s) of _keep_in_fp32_modules in float32 (or as stored)." if kept else "."))
    elif kept and target not in (None, "float32"):
        notes.append(f"{kept} tensor(s) of _keep_in_fp32_modules keep their dtype.")
    return notes


def _logical_shape(tensor) -> tuple[int, ...]:
    """A GGUFParameter's weight shape (its data is rows x bytes of blocks)."""
    # gguf (numpy): imported on use, only for GGUF files
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.quant_type)]
    *rows, row_bytes = tensor.shape
    return (*rows, row_bytes // type_size * block)


def check_converted(converted, planned: list[PlannedTensor]) -> None:
    """What the mapping gave from the data is what it gave from the header (names and shapes the config builds)."""
    comp = converted.comp
    built = {t.name: tuple(t.shape) for t in load_skeleton(comp.name, comp.library, comp.cls, comp.config).tensors
             if t.kind != "buffer_np"}
    got = {t.name: tuple(t.shape) for t in planned}
    if got != built:
        wrong = sorted(set(got) ^ set(built)) or sorted(n for n in got if got[n] != built[n])
        raise SourceError(f"{converted.path.name} converts to tensors its config does not build (first: {wrong[0]}).")
