"""Print the Debian packages the CPU rows of the matrix need: the union of backends/*/pyproject.toml [tool.kvhal] apt."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

root = Path(__file__).resolve().parent.parent
packages: set[str] = set()
for pp in root.glob("backends/*/pyproject.toml"):
    packages.update(tomllib.loads(pp.read_text()).get("tool", {}).get("kvhal", {}).get("apt", []))
sys.stdout.write(" ".join(sorted(packages)) + "\n")
