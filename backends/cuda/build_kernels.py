"""Compile kvhal_cuda/kernels/kvhal.cu ahead of time, no GPU needed (nox -s compile-cuda12/13/rocm).

    python backends/cuda/build_kernels.py cuda13   # nvcc 13.x on PATH: cubins sm_75..sm_121 + PTX compute_120
    python backends/cuda/build_kernels.py cuda12   # NVRTC 12.9 (nvidia-cuda-nvrtc-cu12): sm_70..sm_90 + PTX
    python backends/cuda/build_kernels.py rocm     # Debian hipcc: gfx908 gfx90a gfx1030 code objects

Every compiler gets kvhal_cuda.source.kernel_source(): kvhal.cu with platform.h and the constants generated
from kvhal's format registry inlined (so kvhal must be importable). Writes kvhal_cuda/prebuilt/<target>/
(gitignored, shipped in the wheels) with manifest.json: that source's sha256, compiler, options and
per-artifact arch, size, sha256 and compile seconds. Every warning is an
error (nvcc -Werror all-warnings incl. ptxas spills; an NVRTC log with any warning; hipcc -Werror), and
every artifact is checked to define all kernels. Exit 0 on success, 1 on failure, 3 when the target's
compiler is not installed (one line says which and how to get it).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PKG = HERE / "kvhal_cuda"
MISSING = 3
DEPRECATED_70 = "Architectures prior to '<compute/sm>_75' are deprecated"

TARGETS = {
    # CUDA 13 dropped sm_50..sm_72; sm_88 and the a/f variants are left to PTX/JIT
    "cuda13": {"sass": [75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121], "ptx": [120]},
    "cuda12": {"sass": [70, 75, 80, 86, 87, 89, 90], "ptx": [90]},
    "rocm": {"gfx": ["gfx908", "gfx90a", "gfx1030"]},
}
COMMON = ["--std=c++17"]  # fmad stays on: quantization uses __f*_rn, which never contract
NVCC = [*COMMON, "-O3", "-Werror", "all-warnings", "-Xptxas", "-warn-spills,-warn-lmem-usage"]
# code object v5: what ROCm 6/7 runtimes load (Debian's clang 15 defaults to v4)
HIPCC = ["-std=c++17", "-O3", "-Wall", "-Wextra", "-Werror", "-fno-gpu-flush-denormals-to-zero",
         "-mcode-object-version=5"]  # fmt: skip


def source() -> Any:
    """kvhal_cuda/source.py: the one source every compiler and the runtime see (imports kvhal, not cupy)."""
    sys.path.insert(0, str(HERE))
    try:
        from kvhal_cuda import source
    finally:
        sys.path.remove(str(HERE))
    return source


def kernel_source() -> str:
    return str(source().kernel_source())


def kernel_names() -> list[str]:
    return list(source().kernel_names())


def write_source(directory: Path) -> Path:
    """kernel_source() as a file for nvcc/hipcc, outside the output directory."""
    path = directory / "kvhal.cu"
    path.write_text(kernel_source())
    return path


def check_defines_all(data: bytes, what: str) -> None:
    missing = [n for n in kernel_names() if n.encode() + b"\0" not in data and f".entry {n}(".encode() not in data]
    if missing:
        raise RuntimeError(f"{what} lacks kernels {missing}")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def artifact(kind: str, arch: str, name: str, data: bytes, seconds: float) -> dict:
    """One manifest entry for a compiled file."""
    return {
        "kind": kind,
        "arch": arch,
        "file": name,
        "bytes": len(data),
        "sha256": sha256(data),
        "seconds": round(seconds, 2),
    }


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t
    out = (p.stdout + p.stderr).strip()
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\n{out}")
    if re.search(r"\bwarning\b", out, re.I):
        raise RuntimeError(f"warning treated as error: {' '.join(cmd)}\n{out}")
    return dt, out


# ---- CUDA 13: nvcc ---------------------------------------------------------------------------------------


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "?"


def build_nvcc(out: Path, spec: dict, jobs: int) -> dict:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not on PATH: install the CUDA 13 toolkit (or pip install nvidia-cuda-nvcc==13.*)")
    version = nvcc_version(nvcc)
    if not version.startswith("13."):
        raise FileNotFoundError(f"nvcc on PATH is CUDA {version}, compile-cuda13 needs 13.x")
    jobs_list = [("cubin", f"sm_{a}", ["-cubin", f"-arch=sm_{a}"], f"kvhal.sm_{a}.cubin") for a in spec["sass"]]
    jobs_list += [
        ("ptx", f"compute_{a}", ["-ptx", f"-arch=compute_{a}"], f"kvhal.compute_{a}.ptx") for a in spec["ptx"]
    ]

    with tempfile.TemporaryDirectory() as tmp:
        src = write_source(Path(tmp))

        def one(job: tuple[str, str, list[str], str]) -> dict:
            kind, arch, flags, name = job
            dt, _ = run([nvcc, *flags, *NVCC, "-o", str(out / name), str(src)])
            data = (out / name).read_bytes()
            check_defines_all(data, name)
            return artifact(kind, arch, name, data, dt)

        with ThreadPoolExecutor(jobs) as pool:
            artifacts = list(pool.map(one, jobs_list))
    return {"compiler": f"nvcc {version} ({nvcc})", "options": NVCC, "artifacts": artifacts}


# ---- CUDA 12: NVRTC through its C API (what cuda.bindings.nvrtc wraps), no nvcc, no GPU -------------------


def find_pip_lib(package: str, pattern: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).glob(pattern))
        if hits:
            return hits[-1]
    return None


class Nvrtc:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"

    def check(self, rc: int, what: str, log: str = "") -> None:
        if rc:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}\n{log}")

    def compile(self, src: str, options: list[str], want: str) -> tuple[bytes, str]:
        prog = ctypes.c_void_p()
        self.check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kvhal.cu", 0, None, None), "create")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace").strip()
            self.check(rc, "nvrtcCompileProgram", log)
            get_size, get = (self.lib.nvrtcGetCUBINSize, self.lib.nvrtcGetCUBIN) if want == "cubin" else (
                self.lib.nvrtcGetPTXSize, self.lib.nvrtcGetPTX)  # fmt: skip
            self.check(get_size(prog, ctypes.byref(size)), f"get {want} size")
            out = ctypes.create_string_buffer(size.value)
            self.check(get(prog, out), f"get {want}")
            data = out.raw if want == "cubin" else out.raw.rstrip(b"\0")
            return data, log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def build_nvrtc(out: Path, spec: dict, jobs: int) -> dict:
    lib = find_pip_lib("nvidia.cuda_nvrtc", "lib/libnvrtc.so.12*") or find_pip_lib(
        "nvidia.cuda_nvrtc", "bin/nvrtc64_12*.dll"
    )
    if lib is None:
        raise FileNotFoundError("NVRTC 12 not installed: pip install 'nvidia-cuda-nvrtc-cu12==12.9.*'")
    nvrtc = Nvrtc(lib)
    if not nvrtc.version.startswith("12."):
        raise FileNotFoundError(f"{lib} is NVRTC {nvrtc.version}, compile-cuda12 needs 12.x")
    include = find_pip_lib("nvidia.cuda_runtime", "include")
    base = [*COMMON, "--ptxas-options=--warn-on-spills", "--ptxas-options=--warn-on-local-memory-usage"]
    base += [f"-I{include}"] if include else []
    src = kernel_source()
    jobs_list = [("cubin", f"sm_{a}", f"kvhal.sm_{a}.cubin") for a in spec["sass"]]
    jobs_list += [("ptx", f"compute_{a}", f"kvhal.compute_{a}.ptx") for a in spec["ptx"]]

    def one(job: tuple[str, str, str]) -> dict:
        kind, arch, name = job
        t = time.perf_counter()
        data, log = nvrtc.compile(src, [*base, f"--gpu-architecture={arch}"], kind)
        dt = time.perf_counter() - t
        # NVRTC has no -Werror (nor nvcc's -Wno-deprecated-gpu-targets): any diagnostic fails the build,
        # except the one deprecation notice CUDA 12 prints for sm_70, which is the point of this target
        lines = [ln for ln in log.splitlines() if ln.strip() and not (arch.endswith("_70") and DEPRECATED_70 in ln)]
        if lines:
            raise RuntimeError(f"NVRTC {arch}: warning treated as error:\n{log}")
        check_defines_all(data, name)
        (out / name).write_bytes(data)
        return artifact(kind, arch, name, data, dt)

    with ThreadPoolExecutor(jobs) as pool:
        artifacts = list(pool.map(one, jobs_list))
    opts = [o for o in base if not o.startswith("-I")] + (["-I<nvidia-cuda-runtime-cu12>/include"] if include else [])
    return {"compiler": f"NVRTC {nvrtc.version} ({lib.name})", "options": opts, "artifacts": artifacts}


# ---- ROCm: hipcc ---------------------------------------------------------------------------------------------


def build_hipcc(out: Path, spec: dict, jobs: int) -> dict:
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        raise FileNotFoundError("no hipcc: apt-get install hipcc (Debian's ROCm 5.2 compiler)")
    # without HIP_PLATFORM=amd, hipcc picks NVIDIA whenever nvcc is on PATH
    env = {**os.environ, "HIP_PLATFORM": "amd"}
    version = subprocess.run([hipcc, "--version"], capture_output=True, text=True, env=env).stdout.splitlines()
    version_line = next((v for v in version if v.startswith("HIP version")), "hipcc")

    with tempfile.TemporaryDirectory() as tmp:
        src = write_source(Path(tmp))

        def one(arch: str) -> dict:
            name = f"kvhal.{arch}.hsaco"
            dt, _ = run([hipcc, "--genco", f"--offload-arch={arch}", *HIPCC, "-o", str(out / name), str(src)], env)
            data = (out / name).read_bytes()
            check_defines_all(data, name)
            return artifact("hsaco", arch, name, data, dt)

        with ThreadPoolExecutor(jobs) as pool:
            artifacts = list(pool.map(one, spec["gfx"]))
    checks = [hiprtc_check(spec["gfx"][0])]
    return {"compiler": f"hipcc, {version_line}", "checks": [c for c in checks if c], "options": ["HIP_PLATFORM=amd", "--genco", *HIPCC],
            "artifacts": artifacts}  # fmt: skip


def hiprtc_check(arch: str) -> str:
    """The runtime fallback (cupy on ROCm compiles kernel_source() with hiprtc): it must compile, warning-free."""
    try:
        lib = ctypes.CDLL("libamdhip64.so.5")
    except OSError:
        try:
            lib = ctypes.CDLL("libamdhip64.so")
        except OSError:
            return ""
    lib.hiprtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()
    if lib.hiprtcCreateProgram(ctypes.byref(prog), kernel_source().encode(), b"kvhal.cu", 0, None, None):
        raise RuntimeError("hiprtcCreateProgram failed")
    try:
        opts = [b"-std=c++17", f"--offload-arch={arch}".encode()]
        t = time.perf_counter()
        rc = lib.hiprtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        dt = time.perf_counter() - t
        size = ctypes.c_size_t()
        lib.hiprtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.hiprtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace").strip()
        if rc or log:
            raise RuntimeError(f"hiprtc {arch} ({lib.hiprtcGetErrorString(rc).decode()}), warnings are errors:\n{log}")
    finally:
        lib.hiprtcDestroyProgram(ctypes.byref(prog))
    return f"hiprtc compiles the runtime-fallback source for {arch} warning-free ({dt:.1f} s)"


BUILDERS = {"cuda13": build_nvcc, "cuda12": build_nvrtc, "rocm": build_hipcc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", choices=sorted(TARGETS))
    ap.add_argument("--out", type=Path, default=None, help="default: kvhal_cuda/prebuilt/<target>")
    ap.add_argument("--reuse", action="store_true", help="do nothing if the prebuilt dir matches the source")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    out = args.out or PKG / "prebuilt" / args.target
    if args.reuse and (out / "manifest.json").is_file():
        old = json.loads((out / "manifest.json").read_text())
        if old.get("source_sha256") == sha256(kernel_source().encode()) and all(
            (out / a["file"]).is_file() for a in old.get("artifacts", [])
        ):
            print(f"compile-{args.target}: up to date ({len(old['artifacts'])} artifacts in {out})")
            return 0
    staging = Path(tempfile.mkdtemp(prefix=f"kvhal-{args.target}-", dir=out.parent if out.parent.exists() else None))
    t = time.perf_counter()
    try:
        info = BUILDERS[args.target](staging, TARGETS[args.target], args.jobs)
    except FileNotFoundError as e:
        shutil.rmtree(staging, ignore_errors=True)
        print(f"compile-{args.target}: skipped, {e}")
        return MISSING
    except RuntimeError as e:
        shutil.rmtree(staging, ignore_errors=True)
        print(f"compile-{args.target}: FAILED\n{e}", file=sys.stderr)
        return 1
    manifest = {"target": args.target, "source_sha256": sha256(kernel_source().encode()), **info,
                "kernels": kernel_names(), "wall_seconds": round(time.perf_counter() - t, 1)}  # fmt: skip
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(out)
    total = sum(a["bytes"] for a in info["artifacts"])
    print(f"compile-{args.target}: {info['compiler']}: {len(info['artifacts'])} artifacts, {total / 1024:.0f} KiB, "
          f"{manifest['wall_seconds']} s wall -> {out}")  # fmt: skip
    for a in info["artifacts"]:
        print(f"  {a['arch']:<12} {a['kind']:<6} {a['bytes'] / 1024:8.1f} KiB  {a['seconds']:6.2f} s  {a['file']}")
    for c in info.get("checks", []):
        print(f"  check: {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
