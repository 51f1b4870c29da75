"""The `e3` command line (`e3.cli`): one verb per job, each handler beside the verb's arguments, in one module
per verb group; the handlers parse, call the code they drive and print.

main.py       builds the parser from the groups below and runs a verb (``__main__.py``: ``python -m e3.cli``)
models.py     export, profile, plan, admission, train, evaluate, workload, models
serve.py      serve, infer, demo, perf, load
control.py    control, status
bench.py      bench and its sub-benches
generate.py   export-generate, export-helios, plan-generate
demo.py       what ``e3 demo`` (``make demo``) runs, and the lines that explain its table
reference.py  docs/cli.md generated from the parser (``make docs``)
"""

from e3.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
