"""The `tollgate` command line."""
