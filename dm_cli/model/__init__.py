"""What a SOURCE is: resolving it (folders, files, presets, the Hub cache, the demo), its models on the
meta device (skeletons), weight formats, offline tokenizers, and the inspect and shard cores."""
