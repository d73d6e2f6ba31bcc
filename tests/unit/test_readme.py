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


def test_readme_restart_example_prints_what_the_readme_shows(tmp_path):
    import subprocess
    import sys

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("## A cache that survives restarts") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```\n(reused .*?)\n", section).group(1)
    (tmp_path / "restart_demo.py").write_text(code)
    root = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": root, "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "restart_demo.py", "save"], cwd=tmp_path, check=True, env=env)
    out = subprocess.run([sys.executable, "restart_demo.py", "restore"], cwd=tmp_path, check=True, env=env,
                         capture_output=True, text=True).stdout.strip()
    assert out == shown
