"""``docs/cli.md``, the full command-line reference, generated from the argparse definitions so that it cannot go
stale: ``python -m e3.cli.reference > docs/cli.md`` (or ``make docs``); ``tests/test_cli_reference.py`` fails when
the file and the parser disagree.

Every verb's ``--help`` text as argparse prints it at a fixed width (``WIDTH`` columns, whatever the terminal),
the verbs in the order ``e3 --help`` lists them, the sub-verbs of ``e3 bench`` each in its own section.
"""

from __future__ import annotations

import argparse
import os
import sys

from e3.cli.main import build_parser

__all__ = ["render", "main", "WIDTH"]

WIDTH = 110   # columns the help text is wrapped at (argparse reads $COLUMNS)

HEADER = """# The `e3` command line

Generated from the argparse definitions by `python -m e3.cli.reference > docs/cli.md` (`make docs`); a test
fails when this file and `e3 --help` disagree. Start with the [README](../README.md); what each command is for
and how the parts fit: [architecture.md](architecture.md).
"""


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) of ``parser``'s sub-verbs, in the order they were added."""
    out = []
    for action in parser._actions:   # argparse keeps no public list of sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, sub, helps.get(name, "")))
    return out


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The reference as Markdown (module docstring)."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        if parser is None:
            parser = build_parser()
        verbs = _subcommands(parser)
        lines = [HEADER, "| command | what it does |", "| --- | --- |"]
        lines += [f"| [`e3 {name}`](#e3-{name}) | {text} |" for name, _, text in verbs]
        lines += ["", "## `e3`", "", "```text", parser.format_help().rstrip(), "```"]
        for name, sub, _ in verbs:
            lines += ["", f"## `e3 {name}`", "", "```text", sub.format_help().rstrip(), "```"]
            for sname, ssub, _ in _subcommands(sub):
                lines += ["", f"### `e3 {name} {sname}`", "", "```text", ssub.format_help().rstrip(), "```"]
        return "\n".join(lines) + "\n"
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
