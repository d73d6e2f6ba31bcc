"""Builds the kernels into one plain shared library (no Python C API), loaded with ctypes.

Every ISA is compiled here, at build time, with per-file target pragmas, and picked at run time from
cpuid; so the wheel is one per platform (abi3: any CPython >= 3.10) and first use never compiles.
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# every .c in csrc is one translation unit (each ISA file carries its own target pragmas)
SOURCES = sorted(glob.glob("kvhal_cpu/csrc/*.c"))
if not SOURCES:
    raise SystemExit("kvhal_cpu/csrc/*.c not found: build from backends/cpu (pip install backends/cpu)")


# kern_amx.c writes the tile instructions as asm: a toolchain whose assembler predates AMX (binutils < 2.36)
# builds without it (KV_NO_AMX: stubs that say no), and the CPU's AMX then goes unused
AMX_PROBE = """
int main(void) {
#if defined(__x86_64__)
    __asm__ volatile("tilerelease\\n\\ttdpbf16ps %%tmm2, %%tmm1, %%tmm0\\n\\t"
                     "tileloadd (%0,%1,1), %%tmm3" :: "r"((void *)0), "r"(64L));
#endif
    return 0;
}
"""


class BuildLib(build_ext):
    """A ctypes library, not a module: no PyInit_ symbol is needed or exported."""

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []

    def build_extensions(self) -> None:
        if not self._assembles_amx():
            for ext in self.extensions:
                ext.define_macros.append(("KV_NO_AMX", "1"))
        super().build_extensions()

    def _assembles_amx(self) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "amx_probe.c")
            with open(src, "w") as fh:
                fh.write(AMX_PROBE)
            try:
                self.compiler.compile([src], output_dir=tmp)
            except Exception:  # CompileError, or a compiler that cannot run at all
                return False
        return True


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
