"""LiveStorages: a storage counted once and returned when it dies, on meta as on cpu (the trace and meter rely on it)."""

import pytest

from dm_cli.planning.trace.storages import LiveStorages

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_storage_counts_once_and_returns_when_its_last_tensor_dies(device):
    storages = LiveStorages()
    weight = torch.zeros(8, device=device)
    storages.skip(weight)
    a = torch.zeros(4, 5, device=device)  # 80 bytes
    b = torch.zeros(10, device=device)  # 40 bytes
    view = a[1:]
    for tensor in (a, view, b, weight, weight.t()):
        storages.count(tensor, "x")
    assert storages.live["x"] == 120 and storages.peak["x"] == 120
    del a
    assert storages.live["x"] == 120  # the view keeps the storage alive
    del view
    assert storages.live["x"] == 40
    storages.reset_peaks()
    assert storages.peak["x"] == 40
    del b
    assert storages.live["x"] == 0 and storages.peak["x"] == 40
    storages.count(torch.zeros(3, device=device), "y")  # a temporary: returned as soon as it is counted
    assert storages.live["y"] == 0 and storages.peak["y"] == 12


def test_the_meter_counts_a_tensor_subclass_by_its_inner_tensors():
    """A detached int8 weight shares the weight's inner storages; its own storage is a placeholder of nominal size."""
    from dm_cli.errors import UsageError
    from dm_cli.model.formats.weight_formats import torchao
    from dm_cli.run.load.meter import MemoryMeter

    try:
        quantize_, config = torchao()
    except UsageError as error:
        pytest.skip(str(error))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    quantize_(model, config())
    meter = MemoryMeter()
    meter.register_weights(model, {"": "cpu"}, "cpu")
    meter.start()
    try:
        with torch.no_grad():
            detached = model[0].weight.detach()
    finally:
        meter.stop()
    assert type(detached) is not torch.Tensor and meter.live["cpu"] == 0
