"""Serving a settled run: the loaded pipeline (`session.py`), one prompt (`single.py`), a queue's items and its runner (`queue.py`, `queue_runner.py`) and the outputs (`outputs.py`)."""
