"""The kltq K and V formats on the cpu backend (csrc/kltq.c): store, load and attention with the layer's side data.

The side data (``Pools.side[layer]`` for K, ``Pools.v_side[layer]`` for V: one-layer ``kvhal.formats.kltq.Side``)
becomes one ``kltq_layer`` struct per layer and call settings (V's its own struct, pointed to by K's): each
coefficient's bit start and width in the record, and its levels already scaled by its sigma (the spec's
``codebook[b][j] * sigma``, in f32 as numpy computes them). K in a block format (with kltq V) leaves K's side
fields empty and names its format (``kfmt``).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np

from kvhal.backend import AttentionBatch, Pools
from kvhal.backend_util import format_id
from kvhal.errors import KVHalError
from kvhal.formats import kltq
from kvhal.reference import side as layer_side

from ._abi import c_window

_i32, _i64, _f32, _p = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SYMBOLS = ("kvc_kltq_store", "kvc_kltq_load", "kvc_kltq_attention", "kvc_kltq_attention_mass")


class Layer(ctypes.Structure):
    """``kltq_layer`` of csrc/kltq.c."""


Layer._fields_ = [
    *((name, _i32) for name in ("H", "D", "bs", "vfmt", "isa", "threads")),
    ("krow", _i64),
    ("vrow", _i64),
    *((name, _p) for name in ("start", "width", "off", "levels")),
    *((name, _p) for name in ("mean", "analysis", "synthesis", "sigma", "books", "alloc")),
    ("kfmt", _i32),
    ("v", ctypes.POINTER(Layer)),
]


def declare(lib: ctypes.CDLL) -> bool:
    """Declare the kltq calls; False when the library lacks them (then the backend refuses kltq)."""
    if not all(hasattr(lib, name) for name in SYMBOLS):
        return False
    lp = ctypes.POINTER(Layer)
    lib.kvc_kltq_store.restype, lib.kvc_kltq_store.argtypes = _i32, [lp, _p, _p, _p, _i64, _p, _p]
    lib.kvc_kltq_load.restype, lib.kvc_kltq_load.argtypes = _i32, [lp, _p, _i64, _p, _p, _p, _p]
    lib.kvc_kltq_attention.restype = _i32
    lib.kvc_kltq_attention.argtypes = [lp, _p, _p, _p, _p, _p, _p, _p, _p, *([_i32] * 5), _f32]
    lib.kvc_kltq_attention_mass.restype = _i32
    lib.kvc_kltq_attention_mass.argtypes = [lp, _p, _p, _p, _p, _p, _p, *([_i32] * 5), _f32, _i32, _p, _p]
    return True


# side data (K's, or V's where K is a block format) -> {settings: (struct, what it points into, V's side data)}:
# built once per layer and settings
_built: weakref.WeakKeyDictionary[kltq.Side, dict[tuple[int, ...], tuple[Layer, list[Any], kltq.Side | None]]] = (
    weakref.WeakKeyDictionary()
)


def _side_arrays(side: kltq.Side) -> list[np.ndarray]:
    """What a ``kltq_layer``'s side fields point into, in field order (``start`` .. ``alloc``)."""
    H, D = side.shape[1:]
    width = side.alloc[0].astype(np.int32)  # [H, D]
    start = np.concatenate([np.zeros((H, 1), np.int64), np.cumsum(width, axis=1)[:, :-1]], axis=1).astype(np.int32)
    books = np.ascontiguousarray(side.codebooks[0], np.float32)  # [MAX_BITS + 1, 2^MAX_BITS]
    chunks, off, at = [], np.zeros((H, D), np.int32), 0
    for h in range(H):
        for i in range(D):
            b = int(width[h, i])
            lv = books[b, : 1 << b] * side.sigma[0, h, i] if b else np.zeros(1, np.float32)
            chunks.append(lv.astype(np.float32))
            off[h, i] = at
            at += len(lv)
    return [
        np.ascontiguousarray(a)
        for a in (start, width, off, np.concatenate(chunks), side.mean[0], side.analysis[0], side.synthesis[0],
                  side.sigma[0], books, side.alloc[0])
    ]  # fmt: skip


def layer(pools: Pools, index: int, isa: int, threads: int) -> Layer:
    spec = pools.spec
    kside = layer_side(pools, index) if spec.k_codec else None
    vside = layer_side(pools, index, "v") if spec.v_codec else None
    key = (isa, threads, format_id(spec.k_format), format_id(spec.v_format), spec.block_size, spec.v_row_bytes)
    primary = kside if kside is not None else vside
    assert primary is not None
    per = _built.setdefault(primary, {})
    if key in per and per[key][2] is vside:
        return per[key][0]
    H, D = spec.n_kv_heads, spec.head_dim
    keep: list[Any] = []

    def struct(side: kltq.Side | None, row: int, kfmt: int, v: Any) -> Layer:
        # block K: zero widths (its kernels' per-head setup reads them), no side data
        blank = [np.zeros((H, D), np.int32) for _ in range(3)] + [np.zeros(1, np.float32)]
        arrays = _side_arrays(side) if side is not None else blank
        keep.extend(arrays)
        ptrs = [int(a.ctypes.data) for a in arrays] + [None] * (10 - len(arrays))
        return Layer(H, D, spec.block_size, format_id(spec.v_format), isa, threads, row, spec.v_row_bytes, *ptrs,
                     kfmt, v)  # fmt: skip

    v = None
    if vside is not None:  # V's struct: its records are v_row_bytes long
        keep.append(struct(vside, spec.v_row_bytes, -1, None))
        v = ctypes.pointer(keep[-1])
    st = struct(kside, spec.k_row_bytes, -1 if kside is not None else format_id(spec.k_format), v)
    per[key] = (st, keep, vside)
    return st


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise KVHalError(f"cpu backend kltq {what} failed: error {rc} (out of memory, or head_dim over 512)")


def store(
    lib: Any, pools: Pools, index: int, isa: int, threads: int, k: np.ndarray, v: np.ndarray, slots: np.ndarray
) -> None:
    st = layer(pools, index, isa, threads)
    rc = lib.kvc_kltq_store(ctypes.byref(st), k.ctypes.data, v.ctypes.data, slots.ctypes.data, len(k),
                            pools.k[index].ctypes.data, pools.v[index].ctypes.data)  # fmt: skip
    _check(rc, "store")


def load(
    lib: Any, pools: Pools, index: int, isa: int, threads: int, blocks: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray]:
    spec = pools.spec
    st = layer(pools, index, isa, threads)
    k = np.empty((n, spec.n_kv_heads, spec.head_dim), np.float32)
    v = np.empty_like(k)
    rc = lib.kvc_kltq_load(ctypes.byref(st), blocks.ctypes.data, n, pools.k[index].ctypes.data,
                           pools.v[index].ctypes.data, k.ctypes.data, v.ctypes.data)  # fmt: skip
    _check(rc, "load")
    return k, v


def _tables(batch: AttentionBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block table, seq_lens and q_lens of ``batch`` as the C calls take them."""
    bt, sl, ql = (np.ascontiguousarray(x, dtype=np.int32) for x in (batch.block_table, batch.seq_lens, batch.q_lens))
    return bt, sl, ql


def attention(
    lib: Any, pools: Pools, index: int, isa: int, threads: int, q: np.ndarray, batch: AttentionBatch, with_lse: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    st = layer(pools, index, isa, threads)
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty(q.shape, np.float32)
    lse = np.empty(q.shape[:2], np.float64) if with_lse else None
    bt, sl, ql = _tables(batch)
    rc = lib.kvc_kltq_attention(
        ctypes.byref(st), q.ctypes.data, out.ctypes.data, None if lse is None or not lse.size else lse.ctypes.data,
        pools.k[index].ctypes.data, pools.v[index].ctypes.data, bt.ctypes.data, sl.ctypes.data, ql.ctypes.data,
        sl.shape[0], bt.shape[1], q.shape[1], int(batch.causal), c_window(batch.window), batch.scale,
    )  # fmt: skip
    _check(rc, "attention")
    return out, lse


def attention_mass(
    lib: Any, pools: Pools, index: int, isa: int, threads: int, q: np.ndarray, batch: AttentionBatch,
    lse: np.ndarray, tail: int, total: np.ndarray, window: np.ndarray,
) -> None:  # fmt: skip
    """``kvc_attention_mass`` over the records (q in coefficient space, float32 contiguous; ``lse`` attention's,
    float64 contiguous) into ``total`` and ``window``, laid out as that call lays them out."""
    st = layer(pools, index, isa, threads)
    bt, sl, ql = _tables(batch)
    rc = lib.kvc_kltq_attention_mass(
        ctypes.byref(st), q.ctypes.data, lse.ctypes.data, pools.k[index].ctypes.data, bt.ctypes.data, sl.ctypes.data,
        ql.ctypes.data, sl.shape[0], bt.shape[1], q.shape[1], int(batch.causal), c_window(batch.window), batch.scale, tail,
        total.ctypes.data, window.ctypes.data,
    )  # fmt: skip
    _check(rc, "attention_mass")
