"""The README starts the journey: short (at most 150 lines), and the commands of its "A first hour" block run as
written (the ones that need no server: the served path is what the end-to-end tests exercise), with the
block's scratch folder moved under the test's own temporary folder."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SERVER_STEPS = ("source ", "e3 serve", "e3 infer", "until ", "kill ")   # need the server or the shell


def first_hour_commands() -> list[str]:
    text = README.read_text()
    block = text.split("## A first hour", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            commands.append(re.sub(r"\s+", " ", line))
    return commands


def test_readme_is_at_most_150_lines_and_links_what_it_moved_out():
    text = README.read_text()
    assert len(text.splitlines()) <= 150, len(text.splitlines())
    for page in ("docs/cli.md", "docs/README.md", "docs/own-model.md", "docs/RESULTS.md", "docs/gpu.md"):
        assert page in text and (ROOT / page).exists(), page


def test_the_first_hours_commands_run_as_written(tmp_path):
    commands = first_hour_commands()
    assert any(c.startswith("e3 serve") for c in commands) and any(c.startswith("e3 plan") for c in commands)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "E3_ARTIFACTS": str(tmp_path / "artifacts")}
    ran = []
    for command in commands:
        if command.startswith(SERVER_STEPS):
            continue
        argv = [a.replace("/tmp/e3_first_repo", str(tmp_path / "repo")) for a in shlex.split(command)]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        ran.append(argv[:2])
    assert ["e3", "models"] in ran and ["e3", "export"] in ran and ["e3", "plan"] in ran
    assert (tmp_path / "repo" / "tiny_ee_router" / "config.pbtxt").exists()
