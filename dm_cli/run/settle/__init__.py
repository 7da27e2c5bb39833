"""Settling a run: `settle(request) -> SettledRun`, every check of one run once, in the order `settle.py`'s docstring states."""
