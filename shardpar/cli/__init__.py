"""The `shardpar` command: demo, estimate, env, and the local launcher."""

from shardpar.cli.main import main

__all__ = ["main"]
