"""The `e3` command line (`e3.cli`): one verb per job, each handler beside the verb's arguments, in one module
per verb group; the handlers parse, call the code they drive and print. `main.py` builds the parser."""

from e3.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
