"""Files in and out: atomic writes and in-place swaps, the skeleton and trace cache, safetensors
checkpoints read as hostile input, and the image and video writers. Below everything but the base modules."""
