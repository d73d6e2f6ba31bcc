"""Runs kvhal_cuda's kernels on the CPU: emu/emu.cpp (a fiber-per-thread SIMT emulator) + kvhal.cu, built
with the host C++ compiler, behind the same runtime surface as kvhal_cuda.runtime.CupyRuntime.

Device arrays are numpy arrays with guard bytes on both sides, checked after every launch, so an
out-of-bounds write fails the test that caused it. The emulator runs one launch at a time (its state is
global), so launches from several threads take a lock, as they would queue on one GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
from kvhal_cuda import CudaBackend, source

import kvhal
from kvhal.backend_util import Option, positive

HERE = Path(__file__).parent
GUARD = 64
CANARY = 0xCD


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def build() -> Path:
    """Compile the emulator once per kernel source (cached in the temp dir)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or clang++) to build the CUDA kernel emulator")
    kernels = source.kernel_source()
    tag = hashlib.sha256(((HERE / "emu" / "emu.cpp").read_text() + kernels).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"kvhal-cuda-emu-{tag}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        with tempfile.TemporaryDirectory() as inc:
            (Path(inc) / "kvhal.cu").write_text(kernels)
            cmd = [cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared",
                   "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Werror",
                   "-I", inc, "-o", str(tmp), str(HERE / "emu" / "emu.cpp")]  # fmt: skip
            p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"building the kernel emulator failed:\n{' '.join(cmd)}\n{p.stderr}")
        tmp.replace(out)
    return out


class _GuardedNumpy:
    """numpy, except that zeros/empty return views into buffers with canary bytes around them."""

    def __init__(self) -> None:
        self._live: list[weakref.ref[np.ndarray]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def _alloc(self, shape: Any, dtype: Any, fill: int | None) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buf = np.full(n + 2 * GUARD, CANARY, np.uint8)
        body = buf[GUARD : GUARD + n]
        body[:] = 0 if fill == 0 else 0xA5  # empty() holds garbage, as device memory does
        with self._lock:
            self._live.append(weakref.ref(buf))
        return body.view(dtype).reshape(shape)

    def zeros(self, shape: Any, dtype: Any = np.float64) -> np.ndarray:
        return self._alloc(shape, dtype, 0)

    def empty(self, shape: Any, dtype: Any = np.float64) -> np.ndarray:
        return self._alloc(shape, dtype, None)

    def check(self, kernel: str) -> None:
        with self._lock:
            self._check(kernel)

    def _check(self, kernel: str) -> None:
        alive = []
        for ref in self._live:
            buf = ref()
            if buf is None:
                continue
            alive.append(ref)
            if (buf[:GUARD] != CANARY).any() or (buf[-GUARD:] != CANARY).any():
                raise AssertionError(f"{kernel} wrote outside a device array of {buf.size - 2 * GUARD} bytes")
        self._live = alive


class EmuRuntime:
    """The kvhal_cuda runtime surface on the CPU emulator; ``n_sm`` steers the split-KV heuristic."""

    def __init__(self, n_sm: int = 4) -> None:
        self.lib = ctypes.CDLL(str(build()))
        self.lib.emu_launch.restype = ctypes.c_int
        self.xp = _GuardedNumpy()
        self.n_sm = n_sm
        self.device = contextlib.nullcontext()
        self.launches: list[tuple[str, tuple[int, int, int], tuple[int, int, int], int]] = []
        self._lock = threading.Lock()

    def launch(
        self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple, smem: int = 0
    ) -> None:
        keep, ptrs = [], []
        for a in args:
            if isinstance(a, np.ndarray):
                assert a.flags.c_contiguous, f"{name}: non-contiguous array argument"
                c: Any = ctypes.c_void_p(a.ctypes.data)
            elif isinstance(a, np.int32):
                c = ctypes.c_int(int(a))
            elif isinstance(a, np.int64):
                c = ctypes.c_longlong(int(a))
            elif isinstance(a, np.float32):
                c = ctypes.c_float(float(a))
            else:
                raise TypeError(f"{name}: argument of type {type(a).__name__}; pass np.int32/int64/float32/arrays")
            keep.append(c)
            ptrs.append(ctypes.cast(ctypes.pointer(c), ctypes.c_void_p))
        argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
        err, err_len = ctypes.create_string_buffer(512), ctypes.c_size_t(512)
        with self._lock:
            self.launches.append((name, grid, block, smem))
            rc = self.lib.emu_launch(name.encode(), *grid, *block, ctypes.c_size_t(smem), argv, err, err_len)
            if rc:
                raise AssertionError(err.value.decode())
            self.xp.check(name)

    def to_device(self, a: np.ndarray) -> np.ndarray:
        out = self.xp.empty(a.shape, a.dtype)
        out[...] = a
        return out

    def pointer_table(self, arrays: list[np.ndarray]) -> np.ndarray:
        return self.to_device(np.array([a.ctypes.data for a in arrays], np.uint64))

    def to_host(self, a: Any) -> np.ndarray:
        return np.array(a)  # a copy, as a device-to-host transfer is

    def synchronize(self) -> None:
        pass


class EmulatedCudaBackend(CudaBackend):
    """CudaBackend with its kernels on the CPU emulator: the contract suite runs it as ``cuda-emu``.

    ``n_sm`` (``KVHAL_CUDA_EMU_SMS``) is the SM count the split-KV heuristic plans for; ``prefill`` defaults to
    "kernel" here (``KVHAL_CUDA_EMU_PREFILL``)."""

    name = "cuda-emu"
    OPTIONS = (
        Option("n_sm", int, 4, env="KVHAL_CUDA_EMU_SMS", check=positive),
        # the contract holds kvhal.cu's own prefill kernel to f32's tolerance here; test_cuda_sdpa runs the SDPA route
        dataclasses.replace(CudaBackend.OPTIONS[1], default="kernel", env="KVHAL_CUDA_EMU_PREFILL"),
    )

    @classmethod
    def probe(cls) -> kvhal.Probe:
        return kvhal.Probe(score=-100, reason="kvhal.cu on the CPU SIMT emulator (tests only)", device="emulator")

    def _runtime(self, options: dict[str, Any]) -> EmuRuntime:
        return EmuRuntime(options["n_sm"])
