"""Training recipes built on shardpar (importable so `shardpar demo` and the tests share them)."""
