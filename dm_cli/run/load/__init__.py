"""Components to their planned devices: loading (`loading.py`), overlapped offload (`prefetch.py`) and each stage's measured peaks (`meter.py`)."""
