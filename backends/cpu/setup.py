"""Builds the kernels into one plain shared library (no Python C API), loaded with ctypes.

Every ISA is compiled here, at build time, with per-file target pragmas, and picked at run time from
cpuid; so the wheel is one per platform (abi3: any CPython >= 3.10) and first use never compiles.
"""

from __future__ import annotations

import glob
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# every .c in csrc is one translation unit (each ISA file carries its own target pragmas)
SOURCES = sorted(glob.glob("kvhal_cpu/csrc/*.c"))
if not SOURCES:
    raise SystemExit("kvhal_cpu/csrc/*.c not found: build from backends/cpu (pip install backends/cpu)")


class BuildLib(build_ext):
    """A ctypes library, not a module: no PyInit_ symbol is needed or exported."""

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []


if sys.platform == "win32":
    raise SystemExit("kvhal-cpu builds with GCC or Clang (Linux, macOS); Windows is not supported yet")

args = ["-O3", "-std=c11", "-ffp-contract=off", "-fvisibility=hidden", "-fno-strict-aliasing", "-pthread"]

setup(
    ext_modules=[
        Extension(
            "kvhal_cpu._kvcpu",
            sources=SOURCES,
            extra_compile_args=args,
            extra_link_args=["-pthread"],
            libraries=["m"],
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildLib},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
