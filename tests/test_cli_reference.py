"""docs/cli.md is the argparse definitions rendered (e3.cli.reference): it names every verb of `e3 --help` and
its text is what the parser prints, so a changed option without `make docs` fails here."""

from __future__ import annotations

from pathlib import Path

from e3.cli.main import build_parser
from e3.cli.reference import _subcommands, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_docs_cli_md_is_the_parser_rendered():
    assert DOC.read_text() == render(), "docs/cli.md is stale: run `make docs` (python -m e3.cli.reference)"


def test_every_verb_and_bench_verb_has_its_section_with_its_options():
    text = render()
    verbs = _subcommands(build_parser())
    assert len(verbs) >= 15
    for name, sub, _ in verbs:
        assert f"## `e3 {name}`" in text
        for action in sub._actions:   # every option of every verb is in its section
            for flag in action.option_strings:
                assert flag in text, (name, flag)
        for sname, _, _ in _subcommands(sub):
            assert f"### `e3 {name} {sname}`" in text
