"""The file and storage formats a SOURCE's weights come in, read from their headers alone: GGUF files
(`gguf_files`), single-file checkpoints in an original layout (`single_file_layout`), and fp8/int8 storage
(`weight_formats`). Below the rest of `dm_cli.model`: nothing here builds a model or a skeleton."""
