"""The seed's range and the JSON a request arrives in: checks every entry (the command line, queue lines, the API,
`dmap serve` bodies) shares. The checks of a whole run are `dm_cli.run.settle.settle`'s."""

from __future__ import annotations

import json

from dm_cli.errors import UsageError

# torch.Generator.manual_seed's unsigned range. It also takes negative seeds, but wraps them (-1 is the
# same generator as 2**64 - 2): two seeds, one image, and -1 does not mean "random" as elsewhere.
SEED_RANGE = (0, 2**64 - 1)


def check_seed(seed: int, where: str) -> int:
    """One seed range for `--seed`, queue items and the API (SEED_RANGE)."""
    low, high = SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise UsageError(f"{where} {seed} is out of range: use a whole number from {low} to {high}.")
    return seed


# The most digits a whole number in a request's JSON (a queue line, a `dmap serve` body) may have: a seed, the
# largest number a request takes, has at most 20. Past Python's int-string limit (4300 digits) json.loads raises a
# ValueError, which would read as "not JSON"; such a number is refused as what it is, out of range.
MAX_JSON_DIGITS = 100


def load_json(text: str, where: str):
    """`json.loads(text)`; a whole number of more than MAX_JSON_DIGITS digits is a UsageError naming `where`
    (other malformed JSON raises ValueError, as json.loads does)."""
    def whole_number(digits: str) -> int:
        count = len(digits.lstrip("-"))
        if count > MAX_JSON_DIGITS:
            low, high = SEED_RANGE
            raise UsageError(f"{where} holds a whole number of {count:,} digits, which is out of range: a number here "
                             f"has at most {MAX_JSON_DIGITS} digits (a seed is from {low} to {high}).")
        return int(digits)

    return json.loads(text, parse_int=whole_number)
