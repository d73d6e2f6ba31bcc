"""Print the nox sessions .ci/run runs on a CPU-only machine: the CPU rows of ci/matrix.py present in this checkout.

lint, test-reference, every cpu-tagged backend's test-<variant>, then the GPU build rows that need no GPU:
compile-cuda13, compile-cuda12, compile-rocm, test-cuda-host (kvhal.cu on the CPU emulator) and wheels.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix import cpu_rows  # noqa: E402

sys.stdout.write(" ".join(r.session for r in cpu_rows(only_present=True)) + "\n")
