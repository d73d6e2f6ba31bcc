"""The README's API example runs as written (on the reference backend)."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_example_runs(monkeypatch, capsys):
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.setenv("KVHAL_BACKEND", "reference")
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "backend='reference'" in out and "blocks_shared=1" in out and "tokens=5" in out
