"""Print the nox sessions .ci/run runs on a CPU-only machine: lint, test-reference and every cpu-tagged backend."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

root = Path(__file__).resolve().parent.parent
sessions = ["lint", "test-reference"]
for pp in sorted(root.glob("backends/*/pyproject.toml")):
    table = tomllib.loads(pp.read_text()).get("tool", {}).get("kvhal", {})
    if "cpu" in table.get("tags", ["cpu"]):
        sessions += [f"test-{v}" for v in (table.get("variants") or {pp.parent.name: []})]
sys.stdout.write(" ".join(sessions) + "\n")
