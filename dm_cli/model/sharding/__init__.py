"""The steps of `dmap shard` (`dm_cli.model.shard` is the command): the layout planned, the SOURCE's weights read,
shard files written and copied byte range by byte range, and what was written verified."""
