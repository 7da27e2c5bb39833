"""Ranks sharing a step, as planned: the requests, candidates, memory and time (`parallel.py`, pipeline parallel's cut) and the layout a plan records (`parallel_layout.py`)."""
