"""torchrun ranks sharing a job: CFG and context parallel (`parallel.py`), pipeline parallel (`pipeline.py`) and how its ranks talk (`pipeline_links.py`)."""
