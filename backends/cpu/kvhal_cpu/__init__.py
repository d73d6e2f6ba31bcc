"""kvhal's fast CPU backend: fused attention straight over the quantized pages.

The kernels (``csrc/``) are compiled into one shared library when the package is built and loaded
here with ctypes; the instruction set is picked at run time from cpuid (``KVHAL_CPU_ISA`` or the
``isa`` option forces one). Pools are numpy ``uint8`` arrays in kvhal's layout, so ``to_numpy`` is free
and the bytes are the reference backend's.

Options (``backend_options`` of ``KVCache``, or ``CpuBackend(...)``):
  threads   worker threads; default ``KVHAL_CPU_THREADS`` or ``os.cpu_count()``
  isa       "scalar", "avx2", "avx512" or "neon"; default ``KVHAL_CPU_ISA`` or the best this CPU has
  kv_split  KV tokens per split-KV slice (0: never split); default 1024. Slices depend only on the
            shapes, never on the thread count, so results do not change with ``threads``.
  tile      KV tokens per tile of the AVX-512 kernels: 64, 128, or 0 (default ``KVHAL_CPU_TILE`` or 0: 128
            when K and V are both quantized and the call's K/V fits in a third of the L3, else 64).
            Other ISAs have one tile size and ignore it.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import mmap
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

from kvhal import formats
from kvhal.backend import Backend, LayerPools, Probe
from kvhal.errors import BackendUnavailableError, KVHalError, SpecError
from kvhal.spec import CacheSpec

__all__ = ["CpuBackend", "ISAS", "available_isas", "best_isa"]

ISAS = ("scalar", "avx2", "avx512", "neon")  # enum order of csrc/kvcpu.h
_FMT_IDS = {name: i for i, name in enumerate(("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"))}
DEFAULT_KV_SPLIT = 1024
TILES = (0, 64, 128)
_ERRORS = {-1: "the requested ISA is not supported by this CPU", -2: "out of memory", -3: "invalid arguments"}

_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


def _library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_kvcpu{suffix}"
        if p.exists():
            return p
    return None


def _load() -> ctypes.CDLL:
    """The kernel library, loaded once; raises BackendUnavailableError when it is missing or broken."""
    global _lib, _lib_error
    if _lib is not None:
        return _lib
    if _lib_error is None:
        path = _library_path()
        if path is None:
            _lib_error = (
                "its compiled kernels (kvhal_cpu/_kvcpu*.so) are missing: reinstall kvhal-cpu from a wheel, "
                "or with a C compiler present (pip install kvhal-cpu builds them)"
            )
        else:
            try:
                lib = ctypes.CDLL(str(path))
                _declare(lib)
                if lib.kvc_abi_version() != 2:
                    raise OSError("ABI version mismatch")
                _lib = lib
                return lib
            except (OSError, AttributeError) as e:
                _lib_error = f"its kernel library {path.name} failed to load ({e}); reinstall kvhal-cpu"
    raise BackendUnavailableError(f"backend 'cpu' is unavailable: {_lib_error}")


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "kvc_abi_version": (i, []),
        "kvc_isa_supported": (i, [i]),
        "kvc_best_isa": (i, []),
        "kvc_scan_f32": (i, [p, i64, p]),
        "kvc_store": (i, [i, i, i, i, p, p, i64, i, i, p, p, p, i]),
        "kvc_load": (i, [i, i, i, p, p, i64, i, i, i, p]),
        "kvc_copy_slots": (i, [p, i64, p, p, i64, i, i]),
        "kvc_attention": (i, [i, i, i, i, i, p, p, p, p, p, p, p, i, i, i, i, i, i, f, i, i, i]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def available_isas() -> list[str]:
    """The instruction sets this machine runs, baseline first."""
    lib = _load()
    return [name for k, name in enumerate(ISAS) if lib.kvc_isa_supported(k)]


def best_isa() -> str:
    return ISAS[_load().kvc_best_isa()]


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise BackendUnavailableError(f"{name}={raw!r} is not a non-negative integer; unset it or set e.g. {name}=4")
    return value


def _pick_isa(isa: str | None) -> int:
    requested = isa or os.environ.get("KVHAL_CPU_ISA", "").strip().lower() or "auto"
    lib = _load()
    if requested == "auto":
        return int(lib.kvc_best_isa())
    if requested not in ISAS:
        raise BackendUnavailableError(
            f"KVHAL_CPU_ISA / isa={requested!r} is not one of auto, {', '.join(ISAS)}; unset it to use the best"
        )
    k = ISAS.index(requested)
    if not lib.kvc_isa_supported(k):
        raise BackendUnavailableError(
            f"ISA {requested!r} was requested but this CPU ({platform.machine()}) runs only "
            f"{', '.join(available_isas())}; unset KVHAL_CPU_ISA or pick one of those"
        )
    return k


def _threads(threads: int | None) -> int:
    n = threads if threads is not None else _env_int("KVHAL_CPU_THREADS")
    if n is None or n == 0:
        n = os.cpu_count() or 1
    if not isinstance(n, int) or n < 1:
        raise SpecError(f"threads must be a positive int, got {n!r}")
    return n


_HUGE = 2 << 20


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed uint8 pool; large ones on transparent huge pages where the kernel allows it.

    Attention walks a head's pages in block_size-row chunks spread over the whole pool, a new 4 KiB
    page every chunk; 2 MiB pages keep those walks in the TLB.
    """
    n = int(np.prod(shape))
    if n < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(shape, np.uint8)
    buf = mmap.mmap(-1, n + _HUGE)  # anonymous, zero-filled; extra room to start on a 2 MiB boundary
    base = np.frombuffer(buf, np.uint8)
    start = (-base.ctypes.data) % _HUGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, n - n % mmap.PAGESIZE or n)
    except OSError:
        pass  # THP off: 4 KiB pages still work
    return base[start : start + n].reshape(shape)


def _ptr(a: np.ndarray) -> int:
    # c_char.from_buffer costs a third of a.ctypes.data (0.26 vs 0.8 us; a decode call takes 7 pointers);
    # it needs a writable, contiguous, non-empty buffer
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return int(a.ctypes.data)


class CpuBackend(Backend):
    name = "cpu"
    formats = frozenset(_FMT_IDS)
    # the integer kernels (AVX-512 VNNI: q and p*d_v at 16 bits) measure <= 1.5e-4 on the contract
    # cases; the f32 paths (scalar, AVX2, NEON, and the float formats everywhere) stay near 1e-6.
    # allocate() sets the figure of the path this instance takes.
    attention_tolerance = 3e-4
    INT_TOLERANCE = 3e-4
    F32_TOLERANCE = 1e-5

    @classmethod
    def probe(cls) -> Probe | None:
        try:
            isa = ISAS[_pick_isa(None)]
            threads = _threads(None)
        except KVHalError as e:
            cls._reason = str(e)
            return None
        return Probe(score=50, reason=f"native kernels, {isa}, {threads} threads", device=f"host {platform.machine()}")

    _reason = "its probe found no usable CPU kernels"

    @classmethod
    def unavailable_reason(cls) -> str:
        return cls._reason

    def __init__(
        self,
        *,
        threads: int | None = None,
        isa: str | None = None,
        kv_split: int | None = None,
        tile: int | None = None,
    ) -> None:
        self._lib = _load()
        self.isa = ISAS[_pick_isa(isa)]
        self._isa = ISAS.index(self.isa)
        self.threads = _threads(threads)
        split = kv_split if kv_split is not None else _env_int("KVHAL_CPU_KV_SPLIT")
        if split is None:
            split = DEFAULT_KV_SPLIT
        if not isinstance(split, int) or split < 0:
            raise SpecError(f"kv_split must be a non-negative int (0: never split), got {split!r}")
        self.kv_split = split
        tile = tile if tile is not None else _env_int("KVHAL_CPU_TILE")
        if tile is None:
            tile = 0
        if not isinstance(tile, int) or isinstance(tile, bool) or tile not in TILES:
            raise SpecError(f"tile must be one of {', '.join(map(str, TILES))} (0: chosen per call), got {tile!r}")
        self.tile = tile

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise KVHalError(f"cpu backend {what} failed: {_ERRORS.get(rc, f'error {rc}')}")

    def allocate(self, spec: CacheSpec, n_blocks: int) -> list[LayerPools]:
        self.spec = spec
        self._kf, self._vf = _FMT_IDS[spec.k_format], _FMT_IDS[spec.v_format]
        quantized = spec.k_fmt.block_len > 1 or spec.v_fmt.block_len > 1
        self.attention_tolerance = self.INT_TOLERANCE if self.isa == "avx512" and quantized else self.F32_TOLERANCE
        pools = []
        for _ in range(spec.n_layers):
            k = _zeros(spec.pool_shape(n_blocks, "k"))
            v = _zeros(spec.pool_shape(n_blocks, "v"))
            pools.append(LayerPools(k, v, k.nbytes + v.nbytes))
        return pools

    def check_values(self, fmt: formats.Format, x: Any) -> None:
        a = x if isinstance(x, np.ndarray) else self.to_numpy(x)
        if a.dtype == np.float32 and a.flags.c_contiguous:
            amax = ctypes.c_float()
            bad = self._lib.kvc_scan_f32(_ptr(a), a.size, ctypes.byref(amax))
            if not bad and amax.value <= fmt.max_abs:
                return
        fmt.check_values(np.asarray(a))  # the slow path raises the canonical message

    def store(self, pools: LayerPools, k: Any, v: Any, slots: np.ndarray) -> None:
        spec = self.spec
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        rc = self._lib.kvc_store(
            self._isa, self.threads, self._kf, self._vf, _ptr(k), _ptr(v), k.shape[0], spec.n_kv_heads,
            spec.head_dim, _ptr(pools.k), _ptr(pools.v), _ptr(slots), spec.block_size,
        )  # fmt: skip
        self._check(rc, "store")

    def load(self, pools: LayerPools, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        spec = self.spec
        ids = np.ascontiguousarray(block_ids, dtype=np.int64)
        out = []
        for pool, fmt in ((pools.k, self._kf), (pools.v, self._vf)):
            x = np.empty((n, spec.n_kv_heads, spec.head_dim), np.float32)
            rc = self._lib.kvc_load(
                self._isa, self.threads, fmt, _ptr(pool), _ptr(ids), n, spec.n_kv_heads, spec.head_dim,
                spec.block_size, _ptr(x),
            )  # fmt: skip
            self._check(rc, "load")
            out.append(x)
        return out[0], out[1]

    def attention(
        self,
        q: Any,
        pools: LayerPools,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        q_lens: np.ndarray,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> np.ndarray:
        spec = self.spec
        q = np.ascontiguousarray(q, dtype=np.float32)
        out = np.empty(q.shape, np.float32)
        bt = np.ascontiguousarray(block_table, dtype=np.int32)
        sl = np.ascontiguousarray(seq_lens, dtype=np.int32)
        ql = np.ascontiguousarray(q_lens, dtype=np.int32)
        rc = self._lib.kvc_attention(
            self._isa, self.threads, self.kv_split, self._kf, self._vf, _ptr(q), _ptr(out), _ptr(pools.k),
            _ptr(pools.v), _ptr(bt), _ptr(sl), _ptr(ql), sl.shape[0], bt.shape[1], q.shape[1], spec.n_kv_heads, spec.head_dim,
            spec.block_size, scale, int(causal), int(window or 0), self.tile,
        )  # fmt: skip
        self._check(rc, "attention")
        return out

    def copy_slots(self, pools: LayerPools, src: np.ndarray, dst: np.ndarray) -> None:
        spec = self.spec
        s = np.ascontiguousarray(src, dtype=np.int64)
        d = np.ascontiguousarray(dst, dtype=np.int64)
        for pool, rb in ((pools.k, spec.k_row_bytes), (pools.v, spec.v_row_bytes)):
            self._check(
                self._lib.kvc_copy_slots(
                    _ptr(pool), rb, _ptr(s), _ptr(d), s.shape[0], spec.n_kv_heads, spec.block_size
                ),
                "copy_slots",
            )
