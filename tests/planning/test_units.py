import pytest

from dm_cli.errors import UsageError
from dm_cli.units import DeviceBudget, format_size, parse_device_spec, parse_dtype, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [("16GB", 16 * 10**9), ("16GiB", 16 * 2**30), ("16gb", 16 * 10**9), ("500MB", 500 * 10**6),
     ("1.5GB", 1_500_000_000), ("64KiB", 65536), ("1024", 1024), ("2TB", 2 * 10**12), (" 5 GB ", 5 * 10**9)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "-5GB", "5XB", "", "GB"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_format_size():
    assert format_size(23_802_816_640) == "23.80 GB"
    assert format_size(2**30, binary=True) == "1.00 GiB"
    assert format_size(12) == "12 B"


def test_device_spec_order_and_forms():
    budgets = parse_device_spec("cpu=64GB,cuda:1=16GB,0=16GiB,disk")
    assert budgets == [
        DeviceBudget(0, 16 * 2**30), DeviceBudget(1, 16 * 10**9), DeviceBudget("cpu", 64 * 10**9), DeviceBudget("disk", None)
    ]


@pytest.mark.parametrize("spec", ["0=abc", "0=1GB,0=2GB", "0=-1GB", "disk=0", "gpu=1GB", "0", ""])
def test_device_spec_rejects(spec):
    with pytest.raises(UsageError):
        parse_device_spec(spec)


def test_parse_dtype():
    assert parse_dtype("bf16") == "bfloat16"
    assert parse_dtype("FP16") == "float16"
    assert parse_dtype("fp32") == "float32"
    with pytest.raises(UsageError):
        parse_dtype("int4")
