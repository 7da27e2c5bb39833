"""Where everything goes: the meta-device tracer, the pure placement search, and plans made from
skeletons and traces (plan files, advice). Named `planning`, not `plan`: `dm_cli.plan` is the API function."""
