"""kvhal's fast CPU backend: fused attention straight over the quantized pages.

The kernels (``csrc/``) are compiled into one shared library when the package is built and loaded
here with ctypes (``_abi``); the instruction set is picked at run time from cpuid unless the ``isa``
option forces one. Pools are numpy ``uint8`` arrays in kvhal's layout, so ``to_numpy`` is free and the
bytes are the reference backend's. Options (``backend_options`` of ``KVCache``, or ``CpuBackend(...)``)
are ``OPTIONS`` below, each also read from its environment variable.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import threading
from typing import Any

import numpy as np

from kvhal import formats
from kvhal.backend import AttentionBatch, AttentionShape, HostPoolsBackend, Op, Pools, Probe
from kvhal.backend_util import (
    Option,
    check_block_data,
    check_block_ids,
    format_id,
    non_negative,
    one_of,
    parse_options,
    whole_pages,
)
from kvhal.errors import BackendUnavailableError, KVHalError, ShapeError
from kvhal.interop import OUT_DTYPES as _OUT_DTYPES
from kvhal.interop import LoadOut
from kvhal.spec import CacheSpec

from . import kltq
from ._abi import ERRORS, ISAS, Args, c_window, library_path, open_library

__all__ = ["OPTIONS", "CpuBackend", "ISAS", "available_isas", "best_isa"]

TILES = (0, 64, 128)


def int32_count(x: int) -> str | None:
    """An int >= 0 that kv_args' int32 holds (ctypes would wrap a larger one silently: 2**32 + 1 threads as 1)."""
    return non_negative(x) or (None if x < 2**31 else "must be below 2**31")


OPTIONS = (
    Option("threads", int, 0, env="KVHAL_CPU_THREADS", check=int32_count, help="worker threads; 0: os.cpu_count()"),
    Option(
        "isa", str, "auto", env="KVHAL_CPU_ISA", check=one_of("auto", *ISAS),
        help="instruction set of the kernels; auto: the best this CPU runs",
    ),
    Option(
        "kv_split", int, 1024, env="KVHAL_CPU_KV_SPLIT", check=int32_count,
        help="KV tokens per split-KV slice (0: never split), times the power of two covering rows/128 for work items "
        "of more than 128 query rows (prefill); slices depend on shapes only, so results do not "
        "change with threads",
    ),
    Option(
        "tile", int, 0, env="KVHAL_CPU_TILE", check=one_of(*TILES),
        help="KV tokens per tile of the AVX-512 kernels; 0: 128 when K and V are both quantized and the call's "
        "K/V fits in a third of the L3 or an item holds more than 128 query rows (prefill), else 64",
    ),
)  # fmt: skip

_lib: tuple[ctypes.CDLL, frozenset[str]] | str | None = None  # the library and its formats, or why not
_lib_lock = threading.Lock()


def _library() -> tuple[ctypes.CDLL, frozenset[str]]:
    """The kernel library (loaded once) and the formats it runs; BackendUnavailableError says why not."""
    global _lib
    with _lib_lock:
        if _lib is None:
            path = library_path()
            if path is None:
                _lib = (
                    "its compiled kernels (kvhal_cpu/_kvcpu*.so) are missing: reinstall kvhal-cpu from a wheel, "
                    "or with a C compiler present (pip install kvhal-cpu builds them)"
                )
            else:
                try:
                    _lib = open_library(path)
                except OSError as e:
                    _lib = f"its kernel library {path.name} cannot be used ({e}); reinstall kvhal-cpu"
    if isinstance(_lib, str):
        raise BackendUnavailableError(f"backend 'cpu' is unavailable: {_lib}")
    return _lib


def available_isas() -> list[str]:
    """The instruction sets this machine runs, baseline first."""
    lib, _ = _library()
    return [name for k, name in enumerate(ISAS) if lib.kvc_isa_supported(k)]


def best_isa() -> str:
    return ISAS[_library()[0].kvc_best_isa()]


def _pick_isa(lib: ctypes.CDLL, requested: str) -> int:
    if requested == "auto":
        return int(lib.kvc_best_isa())
    k = ISAS.index(requested)
    if not lib.kvc_isa_supported(k):
        raise BackendUnavailableError(
            f"ISA {requested!r} was requested (isa option or KVHAL_CPU_ISA) but this CPU ({platform.machine()}) "
            f"runs only {', '.join(available_isas())}; pick one of those, or unset it for the best"
        )
    return k


_HUGE = 2 << 20


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed uint8 pool; large ones on transparent huge pages where the kernel allows it.

    Attention walks a head's pages in block_size-row chunks spread over the whole pool, a new 4 KiB
    page every chunk; 2 MiB pages keep those walks in the TLB.
    """
    n = int(np.prod(shape))
    if n < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(shape, np.uint8)
    try:
        buf = mmap.mmap(-1, n + _HUGE)  # anonymous, zero-filled; extra room to start on a 2 MiB boundary
    except OSError as e:  # ENOMEM: what numpy reports as MemoryError (the cache says so as a CapacityError)
        if e.errno != errno.ENOMEM:
            raise
        raise MemoryError(f"cannot map {n} bytes: {e.strerror}") from None
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


class CpuBackend(HostPoolsBackend):
    name = "cpu"
    # what its kernels implement; supports() also refuses any a built library lacks
    formats = frozenset(formats.names())
    # the integer kernels (AVX-512 VNNI: q and p*d_v at 16 bits): the int16 weights p*d_v share one scale
    # per row, 32-value block and KV tile of T tokens, so an output value's error has a standard deviation
    # of at most 2^-15 * sqrt(T/12) * rms(v) = 1.0e-4 for unit-scale V at T = 128 (docs/backends/cpu.md);
    # the figure is 5 of those (the full contract sweep, 714 cases x 5 query seeds, measured 3.8e-4). The
    # f32 paths (scalar, AVX2, NEON, and the float formats everywhere) stay near 1e-6.
    # An instance declares the figure of the kernels its ISA runs.
    INT_TOLERANCE = 5e-4
    F32_TOLERANCE = 1e-5
    attention_tolerance = INT_TOLERANCE
    fused = frozenset({"attention_lse", "attention_mass"})
    masks_heads = True  # attention cuts each KV head's range around its hole (AttentionBatch.holes)

    def masks_heads_of(self, spec: CacheSpec) -> bool:
        return not (spec.k_codec or spec.v_codec)  # csrc/kltq.c's attention has no holes

    @classmethod
    def probe(cls) -> Probe:
        try:
            lib, _ = _library()
        except KVHalError as e:
            return Probe(None, str(e))
        try:  # only the KVHAL_CPU_* variables are read here: an error is this process's settings, not the machine
            opts = parse_options(cls.name, {}, OPTIONS)
            isa = ISAS[_pick_isa(lib, opts["isa"])]
        except KVHalError as e:
            return Probe(None, str(e), misconfigured=True)
        threads = opts["threads"] or os.cpu_count() or 1
        return Probe(50, f"native kernels, {isa}, {threads} threads", device=f"host {platform.machine()}")

    def __init__(self, **options: Any) -> None:
        opts = parse_options(self.name, options, OPTIONS)
        self._lib, self._runs = _library()
        if kltq.declare(self._lib):  # the kltq K and V formats (side data), csrc/kltq.c
            self._runs = self._runs | {f for f in formats.names() if formats.get(f).side_data}
        self.isa = ISAS[_pick_isa(self._lib, opts["isa"])]
        self.threads: int = opts["threads"] or os.cpu_count() or 1
        self.kv_split: int = opts["kv_split"]
        self.tile: int = opts["tile"]
        # amx: the AVX-512 kernels, prefill on the tile unit (bf16 halves, within the f32 figure)
        self.attention_tolerance = self.INT_TOLERANCE if self.isa in ("avx512", "amx") else self.F32_TOLERANCE

    def supports(self, spec: CacheSpec, op: Op, shape: AttentionShape | None = None) -> str | None:
        why = super().supports(spec, op, shape)
        if why is None and (spec.k_codec or spec.v_codec) and spec.head_dim > 512:
            why = f"its kltq kernels take head_dim up to 512, not {spec.head_dim}"
        if why is None and spec.v_codec and spec.k_paged:
            why = f"its kltq kernels take no per-channel K pages ({spec.k_format}) beside kltq V; reference runs them"
        for fmt in (spec.k_format, spec.v_format):
            if why is None and fmt not in self._runs:
                why = f"its kernel library does not implement format {fmt}; it runs {', '.join(sorted(self._runs))}"
        return why

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise KVHalError(f"cpu backend {what} failed: {ERRORS.get(rc, f'error {rc}')}")

    def allocate(self, spec: CacheSpec, n_blocks: int) -> Pools:
        def pools(which: str, coded: bool) -> list[np.ndarray]:
            shape = spec.pool_shape(n_blocks, which)
            if not coded:
                return [_zeros(shape) for _ in range(spec.n_layers)]
            size = int(np.prod(shape))  # kltq: csrc/kltq_avx512.c reads up to 63 bytes past a record
            return [_zeros((size + 128,))[:size].reshape(shape) for _ in range(spec.n_layers)]

        k, v = pools("k", spec.k_codec), pools("v", spec.v_codec)
        isa = ISAS.index(self.isa)
        # per layer: the fields of kv_args that stay fixed for this cache; each call copies its layer's
        layers = [
            Args(
                isa=isa, threads=self.threads, kv_split=self.kv_split, tile=self.tile,
                kfmt=format_id(spec.k_format), vfmt=format_id(spec.v_format), n_kv_heads=spec.n_kv_heads,
                head_dim=spec.head_dim, block_size=spec.block_size, kpaged=spec.k_paged, krow=spec.k_row_bytes,
                vrow=spec.v_row_bytes,
                kpool=_ptr(kp), vpool=_ptr(vp),
            )
            for kp, vp in zip(k, v)
        ]  # fmt: skip
        return Pools(spec, n_blocks, k, v, sum(a.nbytes for a in k + v), state=layers)

    def check_values(self, fmt: formats.Format, x: Any) -> None:
        a = x if isinstance(x, np.ndarray) else self.to_numpy(x)
        if a.dtype == np.float32 and a.flags.c_contiguous:
            amax = ctypes.c_float()
            bad = self._lib.kvc_scan_f32(_ptr(a), a.size, ctypes.byref(amax))
            if not bad and amax.value <= fmt.max_abs:
                return
        fmt.check_values(np.asarray(a))  # the slow path raises the canonical message

    def store(self, pools: Pools, layer: int, k: Any, v: Any, slots: np.ndarray) -> None:
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if pools.spec.k_codec or pools.spec.v_codec:  # K's and V's rows in csrc/kltq.c
            kltq.store(self._lib, pools, layer, ISAS.index(self.isa), self.threads, k, v, slots)
            return
        if pools.spec.k_paged:
            whole_pages(slots, pools.spec.block_size)  # says why the library would refuse them
        a = Args.from_buffer_copy(pools.state[layer])
        a.k, a.v, a.slots, a.n = _ptr(k), _ptr(v), _ptr(slots), k.shape[0]
        self._check(self._lib.kvc_store(a), "store")

    def load(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        if pools.spec.k_codec or pools.spec.v_codec:
            ids = np.ascontiguousarray(block_ids, dtype=np.int64)
            return kltq.load(self._lib, pools, layer, ISAS.index(self.isa), self.threads, ids, n)
        shape = (n, pools.spec.n_kv_heads, pools.spec.head_dim)
        k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
        self._load_to(pools, layer, block_ids, n, 0, k, v, 0)
        return k, v

    def load_into(self, pools: Pools, layer: int, block_ids: np.ndarray, n: int, skip: int, out: LoadOut) -> None:
        """Straight into the caller's buffers: each row dequantized (and narrowed to f16/bf16 through an L1
        scratch row) by the kernels' own dequantization, so a reused output costs no page faults."""
        if pools.spec.k_codec or pools.spec.v_codec:  # kltq: decoded to f32 by its own kernel, then narrowed
            return super().load_into(pools, layer, block_ids, n, skip, out)
        self._load_to(pools, layer, block_ids, n, skip, out.k, out.v, _OUT_DTYPES.index(out.dtype))

    def _load_to(
        self, pools: Pools, layer: int, block_ids: np.ndarray, n: int, skip: int, k: np.ndarray, v: np.ndarray, dt: int
    ) -> None:
        if n - skip <= 0:
            return
        ids = np.ascontiguousarray(block_ids, dtype=np.int64)
        a = Args.from_buffer_copy(pools.state[layer])
        a.blocks, a.n, a.kout, a.vout = _ptr(ids), n, _ptr(k), _ptr(v)
        self._check(self._lib.kvc_load_to(a, skip, dt), "load")

    def attention(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> np.ndarray:
        return self._attention(q, pools, layer, batch, False)[0]

    def attention_lse(self, q: Any, pools: Pools, layer: int, batch: AttentionBatch) -> tuple[np.ndarray, np.ndarray]:
        """``attention`` and each row's log-sum-exp from the same kernel call (the online softmax's max and sum)."""
        out, lse = self._attention(q, pools, layer, batch, True)
        assert lse is not None
        return out, lse

    def attention_mass(
        self, q: Any, pools: Pools, layer: int, batch: AttentionBatch, tail: int, lse: Any = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The weight each key received, from the rows' log-sum-exp (``lse``: ``attention_lse``'s of this very
        call; None: this runs the kernel for it): one more pass of the library's threads that scores ``q K^T``
        tile by tile per KV head, reading K as attention does (a row format's rows, per-channel K pages: kivi; kltq
        records: their coefficients, against ``q`` in coefficient space as attention takes it, with attention's
        ``lse``, which leaves out ``q . mu`` as those scores do), and sums ``exp(s - lse)`` per key
        (``kvc_attention_mass``, ``kvc_kltq_attention_mass``)."""
        spec = pools.spec
        if lse is None:
            lse = self.attention_lse(q, pools, layer, batch)[1]
        lse = np.ascontiguousarray(lse, dtype=np.float64)
        q = np.ascontiguousarray(q, dtype=np.float32)
        if lse.shape != q.shape[:2]:
            raise ShapeError(
                f"lse must be [n_q, n_heads] = {list(q.shape[:2])} (attention_lse's), got {list(lse.shape)}"
            )
        lens = [int(n) for n in batch.seq_lens]
        total, window = np.empty(spec.n_kv_heads * sum(lens)), np.empty(spec.n_kv_heads * sum(lens))
        if total.size and q.size and spec.k_codec:  # kltq records: csrc/kltq.c, through the same driver
            kltq.attention_mass(self._lib, pools, layer, ISAS.index(self.isa), self.threads, q, batch, lse, tail,
                                total, window)  # fmt: skip
        elif total.size and q.size:
            a, _keep = self._call_args(q, pools, layer, batch)
            a.lse = _ptr(lse)
            self._check(self._lib.kvc_attention_mass(a, tail, _ptr(total), _ptr(window)), "attention_mass")
        else:
            total[:], window[:] = 0.0, 0.0
        ends = np.cumsum([0] + [spec.n_kv_heads * n for n in lens])
        return [
            (total[a:b].reshape(spec.n_kv_heads, n), window[a:b].reshape(spec.n_kv_heads, n))
            for a, b, n in zip(ends[:-1], ends[1:], lens)
        ]

    def _call_args(
        self, q: np.ndarray, pools: Pools, layer: int, batch: AttentionBatch
    ) -> tuple[Args, list[np.ndarray]]:
        """``kv_args`` of an attention call on ``layer`` (q f32 contiguous), and the arrays its pointers keep alive."""
        bt = np.ascontiguousarray(batch.block_table, dtype=np.int32)
        sl = np.ascontiguousarray(batch.seq_lens, dtype=np.int32)
        ql = np.ascontiguousarray(batch.q_lens, dtype=np.int32)
        a = Args.from_buffer_copy(pools.state[layer])
        a.q, a.block_table, a.seq_lens, a.q_lens = _ptr(q), _ptr(bt), _ptr(sl), _ptr(ql)
        keep = [bt, sl, ql]
        if batch.holes is not None:  # per-head eviction: each KV head's masked rows
            keep.append(np.ascontiguousarray(batch.holes, dtype=np.int32))
            a.holes = _ptr(keep[-1])
        a.n_seqs, a.max_blocks, a.n_heads = sl.shape[0], bt.shape[1], q.shape[1]
        a.scale, a.causal, a.window = batch.scale, batch.causal, c_window(batch.window)
        return a, keep

    def _attention(
        self, q: Any, pools: Pools, layer: int, batch: AttentionBatch, with_lse: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        if pools.spec.k_codec or pools.spec.v_codec:
            return kltq.attention(self._lib, pools, layer, ISAS.index(self.isa), self.threads, q, batch, with_lse)
        q = np.ascontiguousarray(q, dtype=np.float32)
        out = np.empty(q.shape, np.float32)
        a, _keep = self._call_args(q, pools, layer, batch)
        a.out = _ptr(out)
        lse = np.empty(q.shape[:2], np.float64) if with_lse else None
        if lse is not None and lse.size:
            a.lse = _ptr(lse)
        self._check(self._lib.kvc_attention(a), "attention")
        return out, lse

    def attention_path(self, spec: CacheSpec, n_heads: int, q_len: int) -> str:
        """The kernels an attention call of ``spec`` with ``n_heads`` query heads and ``q_len`` queries per
        sequence runs on this instance: amx-bf16, avx512-vnni, avx512-fma, avx2-gemm, avx2, neon or scalar; kltq-avx512 or
        kltq-scalar for a kltq K or V (csrc/kltq.c's own kernels)."""
        if spec.k_codec or spec.v_codec:
            return "kltq-avx512" if self.isa in ("avx512", "amx") else "kltq-scalar"  # (head_dim % 16 == 0 always)
        a = Args(
            isa=ISAS.index(self.isa), kfmt=format_id(spec.k_format), vfmt=format_id(spec.v_format),
            n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, n_heads=n_heads, kpaged=spec.k_paged,
        )  # fmt: skip
        return str(self._lib.kvc_attention_path(a, q_len).decode())

    def copy_slots(self, pools: Pools, layer: int, src: np.ndarray, dst: np.ndarray) -> None:
        s = np.ascontiguousarray(src, dtype=np.int64)
        d = np.ascontiguousarray(dst, dtype=np.int64)
        a = Args.from_buffer_copy(pools.state[layer])
        a.slots, a.dst_slots, a.n = _ptr(s), _ptr(d), s.shape[0]
        self._check(self._lib.kvc_copy_slots(a), "copy_slots")

    def read_blocks(self, pools: Pools, block_ids: np.ndarray) -> np.ndarray:
        ids = check_block_ids(pools.n_blocks, block_ids)
        out = np.empty((ids.size, pools.spec.block_nbytes), np.uint8)
        self._block_io(pools, ids, out, self._lib.kvc_read_blocks, "read_blocks")
        return out

    def write_blocks(self, pools: Pools, block_ids: np.ndarray, data: np.ndarray) -> None:
        data = np.ascontiguousarray(check_block_data(pools.spec, data))
        ids = check_block_ids(pools.n_blocks, block_ids, len(data))
        self._block_io(pools, ids, data, self._lib.kvc_write_blocks, "write_blocks")

    def _block_io(self, pools: Pools, ids: np.ndarray, raw: np.ndarray, fn: Any, what: str) -> None:
        """Pages of ``ids`` <-> ``raw`` [n, block_nbytes], one memcpy per page on the thread pool."""
        if not ids.size:
            return
        spec = pools.spec
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        # a block named twice is written in order (the last copy wins), so not in parallel
        threads = 1 if what == "write_blocks" and np.unique(ids).size < ids.size else self.threads
        at = _ptr(raw)
        for layer in range(spec.n_layers):
            a = Args.from_buffer_copy(pools.state[layer])
            a.blocks, a.n, a.raw, a.raw_stride, a.threads = _ptr(ids), ids.size, at, spec.block_nbytes, threads
            self._check(fn(a), what)
            at += spec.page_nbytes("k") + spec.page_nbytes("v")
