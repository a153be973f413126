"""The README's Python quickstart runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quickstart_runs(capsys):
    text = README.read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None
    assert len(block.group(1).strip().splitlines()) <= 10
    exec(compile(block.group(1), "README.md", "exec"), {})
    status, value = capsys.readouterr().out.split()
    assert status == "optimal" and 0.9 < float(value) < 1.0


def test_first_screen_has_the_two_commands():
    first_screen = "\n".join(README.read_text().splitlines()[:20])
    assert "make run" in first_screen and "make test" in first_screen
