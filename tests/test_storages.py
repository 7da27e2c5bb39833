"""LiveStorages: a storage counted once and returned when it dies, on meta as on cpu (the trace and meter rely on it)."""

import pytest

from dm_cli.storages import LiveStorages

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
