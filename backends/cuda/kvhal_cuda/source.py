"""The kernel source as one string; no imports beyond the standard library (build_kernels.py loads it by path)."""

from __future__ import annotations

import hashlib
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"


def kernel_source() -> str:
    """kvhal.cu with platform.h inlined: self-contained for NVRTC/hiprtc (no include paths)."""
    header = (KERNEL_DIR / "platform.h").read_text().replace("#pragma once\n", "", 1)  # no longer a header
    return (KERNEL_DIR / "kvhal.cu").read_text().replace('#include "platform.h"', header, 1)


def source_sha256() -> str:
    """What manifests record: a prebuilt binary is used only if it was built from this source."""
    return hashlib.sha256(kernel_source().encode()).hexdigest()
