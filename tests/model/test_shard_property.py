"""Property: any state dict, stored any way, resharded at any size, loads back bitwise equal."""

import json
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dm_cli.model.shard import shard

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
names = st.lists(st.from_regex(r"[a-z_]{1,6}(\.[0-9]{1,2})?(\.[a-z]{1,5}){0,2}", fullmatch=True), min_size=1,
                 max_size=12, unique=True)
shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3)


def random_tensor(dtype, shape, seed):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=generator, dtype=dtype)


@st.composite
def state_dicts(draw):
    keys = draw(names)
    state = {}
    for i, key in enumerate(keys):
        if i and draw(st.booleans()) and draw(st.booleans()):  # ~1 in 4: share an earlier tensor's storage
            state[key] = state[keys[draw(st.integers(0, i - 1))]]
        else:
            state[key] = random_tensor(draw(st.sampled_from(DTYPES)), tuple(draw(shapes)), draw(st.integers(0, 2**31)))
    return state


def load_output(folder: Path) -> tuple[dict, dict]:
    """All tensors of the output and the dropped-name metadata, as a loader would see them."""
    from safetensors import safe_open

    indexes = list(folder.glob("*.index.json"))
    files = sorted(folder.glob("*.safetensors"))
    metadata = {}
    if indexes:
        index = json.loads(indexes[0].read_text())
        assert set(index["weight_map"].values()) == {f.name for f in files}
        metadata = {k: v for k, v in index["metadata"].items() if k not in ("total_size", "total_parameters")}
    else:
        assert len(files) == 1
    tensors = {}
    for path in files:
        with safe_open(path, "pt") as handle:
            if not indexes:
                metadata = {k: v for k, v in handle.metadata().items() if k != "format"}
            for key in handle.keys():
                assert key not in tensors
                tensors[key] = handle.get_tensor(key)
    return tensors, metadata


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(state=state_dicts(), stored_as=st.sampled_from(["bin", "safetensors", "sharded"]),
       limit_fraction=st.floats(0.0, 1.2), source_fraction=st.floats(0.05, 1.0))
def test_reshard_random_state_dicts(state, stored_as, limit_fraction, source_fraction):
    from huggingface_hub import save_torch_state_dict

    total = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "src").mkdir()
        if stored_as == "bin":
            torch.save(state, tmp / "src" / "pytorch_model.bin")
            source = tmp / "src" / "pytorch_model.bin"
        else:
            # huggingface_hub drops shared names itself and records them in the metadata
            save_torch_state_dict(state, tmp / "src", max_shard_size=max(1, int(total * source_fraction)) if stored_as == "sharded" else 10**12)
            index = tmp / "src" / "model.safetensors.index.json"
            source = index if index.is_file() else tmp / "src" / "model.safetensors"
        limit = int(total * limit_fraction) + (300 if limit_fraction else 0)
        result = shard(str(source), limit, output=tmp / "out", min_shard_size=1)
        assert result.verified

        tensors, metadata = load_output(tmp / "out")
        for name, original in state.items():
            kept = metadata.get(name, name) if name not in tensors else name
            assert kept in tensors, name
            got = tensors[kept]
            assert got.dtype == original.dtype and got.shape == original.shape, name
            assert torch.equal(got, original), name
        assert set(tensors) <= set(state)
        for shard_file in result.components[0].shards:
            size = (tmp / "out" / shard_file.name).stat().st_size
            assert size == shard_file.file_bytes
            if limit:
                assert size <= limit or len(shard_file.tensors) == 1, (size, limit)


def test_dropped_shared_name_survives_when_only_its_metadata_overflows_the_limit(tmp_path):
    """Found by the property above: the whole model fit the limit only without the dropped-name metadata."""
    weight = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    (tmp_path / "src").mkdir()
    torch.save({"_": weight, "c": weight}, tmp_path / "src" / "pytorch_model.bin")
    result = shard(str(tmp_path / "src" / "pytorch_model.bin"), 492, output=tmp_path / "out", min_shard_size=1)
    assert result.verified
    tensors, metadata = load_output(tmp_path / "out")
    assert list(tensors) == ["_"] and metadata == {"c": "_"}
    assert torch.equal(tensors["_"], weight)
