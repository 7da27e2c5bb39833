"""Generating: a run request settled and checked before anything loads, the session that loads
components per the plan and runs the stage loop, outputs, and its peers over it (one prompt, a queue,
torchrun ranks)."""
