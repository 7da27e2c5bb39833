"""What a launch printed, read back: every JSON object in its stdout (each rank of a torchrun launch prints its own
`--json` result). Shared by the benchmarks and the tests that launch dmap."""

from __future__ import annotations

import json


def json_results(output: str) -> list[dict]:
    """Every JSON object in `output`, in order."""
    results, decoder = [], json.JSONDecoder()
    while "{" in output:
        obj, end = decoder.raw_decode(output, output.index("{"))
        results.append(obj)
        output = output[end:]
    return results
