"""The `plait` command line: one module per command, and the argument parser. Imports anything below it;
nothing imports it but plait's entry points."""

from plait.cli.main import main

__all__ = ["main"]
