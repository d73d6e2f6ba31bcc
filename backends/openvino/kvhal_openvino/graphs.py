"""The OpenVINO graphs of the openvino backend: quantize (store), dequantize (load) and paged attention.

Imported only when the backend is instantiated (``import openvino`` costs ~0.3 s). OpenVINO has no
bitcast, so the graphs read and write a pool through *typed views of the same bytes* (numpy ``.view``
of the host pool): f32/f16/bf16 rows as their own type, q8_0's quants as ``i8``, other quantized
bytes as ``u8``; fp16 scales are decoded by lookup in a table of all 65536 fp16 values, bit fields
by lookup tables. Every arithmetic step is exact in f32 (integer-valued quants, power-of-two factors),
so the graphs reproduce ``kvhal/formats/ggml.py`` bit for bit.

Every dimension that changes between calls (tokens, blocks, sequences, queries) is dynamic, so a
graph is compiled once per (formats, heads, head_dim, block_size) and never per step.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvhal import formats
from kvhal.spec import CacheSpec

# every quantized format stores 32-value blocks (ggml's QK), unpacked below as two 16-value halves
QK = formats.get("q8_0").block_len
I64 = np.int64

# the typed views of a pool row each format's dequantizer reads
VIEWS: dict[str, tuple[str, ...]] = {
    "f32": ("f32",),
    "f16": ("f16",),
    "bf16": ("bf16",),
    "q8_0": ("u8", "i8"),
    "q4_0": ("u8",),
    "q4_1": ("u8",),
    "q5_0": ("u8",),
    "q5_1": ("u8",),
}
OV_TYPES: dict[str, Any] = {
    "f32": ov.Type.f32,
    "f16": ov.Type.f16,
    "bf16": ov.Type.bf16,
    "u8": ov.Type.u8,
    "i8": ov.Type.i8,
}
NP_TYPES: dict[str, Any] = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "u8": np.uint8, "i8": np.int8}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}
# The CPU plugin converts a whole f16/bf16 input to f32 before the first node (exactly: subnormals and
# signed zeros kept), a pass over the pool per call: such pools are fed only the pages a call reads.
# u8, i8 and f32 inputs are read in place.
COPIED_VIEWS = frozenset({"f16", "bf16"})
# every fp16 value as f32, indexed [low byte, high byte]: the fp16 scales of quantized blocks are
# decoded by one exact GatherND over their byte pairs (an OpenVINO graph has no bitcast)
_F16_VALUES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
F16_TABLE = _F16_VALUES.reshape(256, 256).T.copy()
# fp16 scales (and mins) that head each block; the rest of the block is the u8/i8 body
N_SCALES = {"q8_0": 1, "q4_0": 1, "q4_1": 2, "q5_0": 1, "q5_1": 2}


def const(v: Any, dtype: Any = np.float32) -> ov.Node:
    return ops.constant(np.asarray(v, dtype))


def _last(x: ov.Node, a: int, b: int) -> ov.Node:
    """``x[..., a:b]``."""
    return ops.slice(x, const([a], I64), const([b], I64), const([1], I64), const([-1], I64))


def _split_last(x: ov.Node, lead: int, *shape: int) -> ov.Node:
    """Reshape the last axis into ``shape``, keeping ``lead`` leading (dynamic) axes."""
    return ops.reshape(x, const([0] * lead + list(shape), I64), special_zero=True)


def _f32(x: ov.Node) -> ov.Node:
    return ops.convert(x, "f32")


def _half(raw: ov.Node, lead: int, n: int) -> ov.Node:
    """u8 ``[*lead, 2n]`` (little-endian fp16 fields) -> their f32 values ``[*lead, n]``."""
    return ops.gather_nd(const(F16_TABLE), ops.convert(_split_last(raw, lead, n, 2), "i32"))


# Bit fields are unpacked by lookup: each value's byte is gathered to the value's position, offset into
# a table of 256 entries per field (scalar gathers run as JIT kernels on the CPU plugin, row gathers
# and concats do not). Values come out in value order.
_J = np.arange(QK)
NIBBLE_BYTE = _J % 16  # value j lives in byte j % 16 ...
NIBBLE_FIELD = (_J // 16) * 256  # ... low nibble for j < 16, high nibble above


# entry field*256 + byte: the nibble minus the format's offset (q4_0: 8; q5_0: 16, its high bit added later)
def _nibble_table(offset: float) -> np.ndarray:
    table: np.ndarray = (np.r_[np.arange(256) & 15, np.arange(256) >> 4] - offset).astype(np.float32)
    return table


HIGH_BYTE = _J // 8  # the fifth bit of value j is bit j % 8 of qh byte j // 8
HIGH_FIELD = (_J % 8) * 256
HIGH_TABLE = (((np.arange(256)[None, :] >> np.arange(8)[:, None]) & 1) * 16).astype(np.float32).reshape(-1)


def _lookup(packed: ov.Node, byte: np.ndarray, field: np.ndarray, table: np.ndarray) -> ov.Node:
    """u8 ``[..., n]`` -> f32 ``[..., 32]``: ``table[field[j] + packed[..., byte[j]]]``."""
    idx = ops.add(ops.gather(ops.convert(packed, "i32"), const(byte, np.int32), const(-1, I64)), const(field, np.int32))
    return ops.gather(const(table), idx, const(0, I64))


def _nibbles(qs: ov.Node, offset: float) -> ov.Node:
    return _lookup(qs, NIBBLE_BYTE, NIBBLE_FIELD, _nibble_table(offset))


def _high_bits(qh: ov.Node) -> ov.Node:
    return _lookup(qh, HIGH_BYTE, HIGH_FIELD, HIGH_TABLE)


# ---- dequantize: typed views [*lead, row] -> f32 [*lead, head_dim] ------------------------------------


def dequantize(fmt: str, views: dict[str, ov.Node], lead: int, dim: int) -> ov.Node:
    """The f32 values of rows ``[*lead, row]`` -> ``[*lead, dim]``."""
    if fmt == "f32":
        return views["f32"]
    if fmt in ("f16", "bf16"):
        return _f32(views[fmt])
    f = formats.get(fmt)
    nb, bb, blead = dim // f.block_len, f.block_bytes, lead + 1
    body = _split_last(views["u8"], lead, nb, bb)
    scales = _half(_last(body, 0, 2 * N_SCALES[fmt]), blead, N_SCALES[fmt])  # [*lead, nb, 1 or 2]
    d = _last(scales, 0, 1)
    if fmt == "q8_0":
        x = ops.multiply(d, _f32(_last(_split_last(views["i8"], lead, nb, bb), 2, bb)))
    elif fmt == "q4_0":
        x = ops.multiply(d, _nibbles(_last(body, 2, bb), 8.0))
    elif fmt == "q4_1":
        x = ops.add(ops.multiply(d, _nibbles(_last(body, 4, bb), 0.0)), _last(scales, 1, 2))
    elif fmt == "q5_0":
        x = ops.multiply(d, ops.add(_nibbles(_last(body, 6, bb), 16.0), _high_bits(_last(body, 2, 6))))
    elif fmt == "q5_1":
        q = ops.add(_nibbles(_last(body, 8, bb), 0.0), _high_bits(_last(body, 4, 8)))
        x = ops.add(ops.multiply(d, q), _last(scales, 1, 2))
    else:  # pragma: no cover - guarded by OpenVINOBackend.formats
        raise ValueError(fmt)
    return _split_last(x, lead, dim)


# ---- quantize: f32 [n, H, D] -> the parts of each row ------------------------------------------------


def _inverse(d: ov.Node) -> ov.Node:
    """ggml's ``id = d ? 1/d : 0``, and 0 where a subnormal d's inverse overflows (as the reference)."""
    inv = ops.divide(const(1.0), d)
    ok = ops.logical_and(ops.not_equal(d, const(0.0)), ops.is_finite(inv))
    return ops.select(ok, inv, const(0.0))


def _div_const(a: ov.Node, c: int) -> ov.Node:
    """Correctly rounded ``a / c`` for a small positive integer ``c``.

    OpenVINO's CPU plugin computes ``Divide`` as ``a * (1/c)``, one ulp off for a third of inputs.
    Take that quotient, get its residual ``a - q*c`` exactly (Veltkamp split: every partial product
    of a 12-bit half of q and a small integer c is exact, and the residual is representable, so this
    holds with or without fused multiply-adds), then correct by ``r / c``: a/c lies at least
    ulp/(2c) from any rounding midpoint, far more than the correction's own error.
    """
    inv = const(np.float32(1) / np.float32(c))
    q = ops.multiply(a, inv)
    t = ops.multiply(q, const(4097.0))
    q_hi = ops.subtract(t, ops.subtract(t, q))
    q_lo = ops.subtract(q, q_hi)
    r = ops.subtract(ops.subtract(a, ops.multiply(q_hi, const(float(c)))), ops.multiply(q_lo, const(float(c))))
    return ops.add(q, ops.multiply(r, inv))


def _neg_div_pow2(a: ov.Node, c: float) -> ov.Node:
    """``a / -c`` for a power of two ``c``; a zero ``a`` (an all-zero block, +0 in ggml) gives -0.

    The CPU plugin turns a multiply by a scalar constant into ``x*s + 0``, which makes every zero
    +0, so the reference's d = +0 / -c = -0 (bytes 00 80) is selected explicitly.
    """
    return ops.select(ops.equal(a, const(0.0)), const(-0.0), ops.multiply(a, const(-1.0 / c)))


def _first(b: ov.Node, key: ov.Node, target: ov.Node) -> ov.Node:
    """Per block, the element of ``b`` at the first position where ``key == target`` (ggml's loop order)."""
    j = const(np.arange(QK, dtype=np.float32))
    idx = ops.reduce_min(ops.select(ops.equal(key, target), j, const(float(QK))), const([-1], I64), keep_dims=True)
    return ops.gather_elements(b, ops.convert(idx, "i32"), -1)


def _signed_absmax(b: ov.Node) -> ov.Node:
    """The value of largest magnitude with its sign, first occurrence on ties (q4_0/q5_0)."""
    mag = ops.abs(b)
    return _first(b, mag, ops.reduce_max(mag, const([-1], I64), keep_dims=True))


def _pack_nibbles(q: ov.Node) -> ov.Node:
    """f32 quants ``[..., 32]`` in 0..15 -> u8 ``[..., 16]``."""
    return ops.convert(ops.add(_last(q, 0, QK // 2), ops.multiply(_last(q, QK // 2, QK), const(16.0))), "u8")


def _pack_high_bits(q: ov.Node, lead: int) -> tuple[ov.Node, ov.Node]:
    """f32 quants 0..31 -> (u8 ``[..., 4]`` little-endian bit j = fifth bit of value j, low nibbles 0..15)."""
    h = _f32(ops.greater_equal(q, const(16.0)))
    weights = const(2.0 ** (np.arange(QK) % 8))
    qh = ops.reduce_sum(_split_last(ops.multiply(h, weights), lead, 4, 8), const([-1], I64), keep_dims=False)
    return ops.convert(qh, "u8"), ops.subtract(q, ops.multiply(h, const(16.0)))


def quantize(fmt: str, x: ov.Node, dim: int) -> list[ov.Node]:
    """The parts of the stored rows, in row order: for quantized formats (f16 scales, u8/i8 body)."""
    lead = 2
    if fmt == "f32":
        # stored as is: the caller copies the input's bytes (a pass-through Parameter->Result graph
        # makes the CPU plugin alias a stale input buffer)
        return []
    if fmt == "f16":
        return [ops.convert(x, "f16")]  # IEEE round to nearest even
    if fmt == "bf16":
        return [_bf16_quantize(x, lead, dim)]
    b = _split_last(x, lead, dim // QK, QK)  # quantized formats only: blocks of QK values
    blead = lead + 1
    if fmt == "q8_0":
        d = _div_const(ops.reduce_max(ops.abs(b), const([-1], I64), keep_dims=True), 127)
        y = ops.multiply(b, _inverse(d))
        # C roundf, half away from zero, without the f32 "+ 0.5" (0.49999997 + 0.5 rounds to 1.0):
        # the fraction |y| - floor(|y|) is exact (Sterbenz), so compare it with 0.5
        mag = ops.abs(y)
        whole = ops.floor(mag)
        up = _f32(ops.greater_equal(ops.subtract(mag, whole), const(0.5)))
        q = ops.multiply(ops.sign(y), ops.add(whole, up))
        return [ops.convert(d, "f16"), ops.convert(q, "i8")]
    if fmt in ("q4_0", "q5_0"):
        half = 8.0 if fmt == "q4_0" else 16.0
        d = _neg_div_pow2(_signed_absmax(b), half)
        # x*id + half + 0.5 >= 0 here, so floor is the reference's trunc
        y = ops.floor(ops.add(ops.multiply(b, _inverse(d)), const(half + 0.5)))
        q = ops.minimum(y, const(2 * half - 1))
        scales = [ops.convert(d, "f16")]
    else:
        top = 15.0 if fmt == "q4_1" else 31.0
        # ggml's loop keeps the first of equal minima/maxima: that decides the sign of a zero min/max
        lo = _first(b, b, ops.reduce_min(b, const([-1], I64), keep_dims=True))
        hi = _first(b, b, ops.reduce_max(b, const([-1], I64), keep_dims=True))
        d = _div_const(ops.subtract(hi, lo), int(top))
        y = ops.floor(ops.add(ops.multiply(ops.subtract(b, lo), _inverse(d)), const(0.5)))
        q = ops.minimum(y, const(top))
        scales = [ops.convert(ops.concat([d, lo], -1), "f16")]
    if fmt in ("q4_0", "q4_1"):
        return [*scales, _pack_nibbles(q)]
    qh, low = _pack_high_bits(q, blead)
    return [*scales, ops.concat([qh, _pack_nibbles(low)], -1)]


def _bf16_quantize(raw: ov.Node, lead: int, dim: int) -> ov.Node:
    """f32 bytes -> bf16 bits (u16), ggml's round to nearest even on the upper 16 bits (finite inputs).

    The byte pairs are combined by matmuls with [1, 256] weights (integers below 2**17: exact in any
    summation order), which keeps every tensor [..., dim] wide.
    """
    b = _f32(_split_last(raw, lead, dim, 4))  # little-endian bytes b0..b3
    low = ops.matmul(b, const([1.0, 256.0, 0.0, 0.0]), False, False)
    high = ops.matmul(b, const([0.0, 0.0, 1.0, 256.0]), False, False)
    odd = ops.subtract(high, ops.multiply(ops.floor(ops.multiply(high, const(0.5))), const(2.0)))
    up = _f32(ops.greater(ops.add(low, odd), const(32768.0)))
    return ops.convert(ops.add(high, up), "u16")


# ---- models ----------------------------------------------------------------------------------------


def _pool_params(fmt: str, heads: int, block_size: int, dim: int, which: str) -> dict[str, ov.Node]:
    """One Parameter per typed view of a pool ``[n_blocks, heads, block_size, row]`` (n_blocks dynamic)."""
    row = formats.get(fmt).row_bytes(dim)
    return {
        view: ops.parameter([-1, heads, block_size, row // ITEMSIZE[view]], OV_TYPES[view], name=f"{which}_{view}")
        for view in VIEWS[fmt]
    }


def store_model(k_fmt: str, v_fmt: str, heads: int, dim: int) -> ov.Model:
    """k, v ``[n, heads, dim]`` (f32, or their bytes for bf16) -> the parts of their stored rows."""
    params, results = [], []
    for fmt, which in ((k_fmt, "k"), (v_fmt, "v")):
        if fmt == "f32":
            continue
        kind = "u8" if fmt == "bf16" else "f32"  # bf16 rounds the input's bits
        p = ops.parameter([-1, heads, dim * 4 // ITEMSIZE[kind]], OV_TYPES[kind], name=which)
        params.append(p)
        results += [ops.result(part) for part in quantize(fmt, p, dim)]
    return ov.Model(results, params, "kvhal_store")


def load_model(k_fmt: str, v_fmt: str, heads: int, block_size: int, dim: int) -> ov.Model:
    """(K views, V views, block_ids [nb]) -> K, V ``[nb * block_size, heads, dim]`` f32."""
    ids = ops.parameter([-1], np.int32, name="block_ids")
    params, results = [], []
    for fmt, which in ((k_fmt, "k"), (v_fmt, "v")):
        views = _pool_params(fmt, heads, block_size, dim, which)
        params += list(views.values())
        pages = {name: ops.gather(p, ids, const(0, I64)) for name, p in views.items()}  # [nb, H, bs, row]
        x = dequantize(fmt, pages, 3, dim)  # [nb, H, bs, D]
        x = ops.transpose(x, const([0, 2, 1, 3], I64))
        results.append(ops.result(ops.reshape(x, const([-1, heads, dim], I64), special_zero=False)))
    return ov.Model(results, [*params, ids], "kvhal_load")


def attention_model(k_fmt: str, v_fmt: str, n_heads: int, kv_heads: int, block_size: int, dim: int) -> ov.Model:
    """Paged attention over the quantized pools, sequences batched and padded to the longest.

    Inputs besides q and the pool views (all small host int arrays): ``table [S, MB]`` page ids,
    ``rows [S, Qc]`` the q row of each padded query slot, and ``hi``/``lo`` ``[S, Qc*G]``: a query
    sees KV position j iff ``lo < j <= hi``. Output: ``[S, Qc, n_heads, dim]`` f32 (padded slots
    repeat a real query; the caller drops them).

    The gathered pages stay page-major, ``[S, MB, Hkv, bs, D]``: scores are batched matmuls per page
    (q broadcast over pages) and P·V sums the per-page products, so no K/V-sized transpose is made;
    only scores and probabilities (G·Qc/D the size of K in decode) change layout for the softmax.
    """
    g = n_heads // kv_heads
    q = ops.parameter([-1, n_heads, dim], np.float32, name="q")
    table = ops.parameter([-1, -1], np.int32, name="table")
    rows = ops.parameter([-1, -1], np.int32, name="rows")
    hi = ops.parameter([-1, -1], np.int32, name="hi")
    lo = ops.parameter([-1, -1], np.int32, name="lo")
    scale = ops.parameter([], np.float32, name="scale")
    params: list[ov.Node] = [q]
    kv = []
    for fmt, which in ((k_fmt, "k"), (v_fmt, "v")):
        views = _pool_params(fmt, kv_heads, block_size, dim, which)
        params += list(views.values())
        pages = {name: ops.gather(p, table, const(0, I64)) for name, p in views.items()}  # [S, MB, Hkv, bs, row]
        kv.append(dequantize(fmt, pages, 4, dim))  # [S, MB, Hkv, bs, D]
    k, v = kv
    # queries grouped by the KV head they read: [S, 1, Hkv, Qc*G, D], row r = (query r // G, head r % G)
    qs = ops.gather(ops.multiply(q, scale), rows, const(0, I64))  # [S, Qc, Hq, D]
    qs = ops.reshape(qs, const([0, 0, kv_heads, g, dim], I64), special_zero=True)
    qs = ops.transpose(qs, const([0, 2, 1, 3, 4], I64))
    qs = ops.unsqueeze(ops.reshape(qs, const([0, 0, -1, dim], I64), special_zero=True), const([1], I64))
    scores = ops.matmul(qs, k, False, True)  # [S, MB, Hkv, Qc*G, bs]
    scores = ops.transpose(scores, const([0, 2, 3, 1, 4], I64))
    scores = ops.reshape(scores, const([0, 0, 0, -1], I64), special_zero=True)  # [S, Hkv, Qc*G, L]
    n_ctx = ops.gather(ops.shape_of(scores, "i32"), const(3, I64), const(0, I64))
    j = ops.range(const(0, np.int32), n_ctx, const(1, np.int32), "i32")
    hi4 = ops.unsqueeze(hi, const([1, 3], I64))  # [S, 1, Qc*G, 1]
    lo4 = ops.unsqueeze(lo, const([1, 3], I64))
    visible = ops.logical_and(ops.less_equal(j, hi4), ops.greater(j, lo4))
    p = ops.softmax(ops.select(visible, scores, const(-np.inf)), -1)
    p = ops.reshape(p, const([0, 0, 0, -1, block_size], I64), special_zero=True)
    p = ops.transpose(p, const([0, 3, 1, 2, 4], I64))  # [S, MB, Hkv, Qc*G, bs]
    out = ops.reduce_sum(ops.matmul(p, v, False, False), const([1], I64), keep_dims=False)  # [S, Hkv, Qc*G, D]
    out = ops.reshape(out, const([0, 0, -1, g, dim], I64), special_zero=True)
    out = ops.transpose(out, const([0, 2, 1, 3, 4], I64))  # [S, Qc, Hkv, G, D]
    out = ops.reshape(out, const([0, 0, n_heads, dim], I64), special_zero=True)
    return ov.Model([ops.result(out)], [*params, table, rows, hi, lo, scale], "kvhal_attention")


# ---- compile cache -----------------------------------------------------------------------------------

_CORE: ov.Core | None = None
_COMPILED: dict[tuple[Any, ...], ov.CompiledModel] = {}
_LOCK = threading.RLock()  # caches on several threads share one Core and compile each graph once
compiles = 0  # compile_model calls made by this process (the compile-cache test watches it)


def core() -> ov.Core:
    global _CORE
    with _LOCK:
        if _CORE is None:
            _CORE = ov.Core()
        return _CORE


@functools.lru_cache(maxsize=1)
def available_devices() -> tuple[str, ...]:
    """Devices OpenVINO sees (cached: enumerating GPUs loads their driver)."""
    return tuple(core().available_devices)


VIRTUAL_DEVICES = ("AUTO", "HETERO", "MULTI", "BATCH")


def config(device: str) -> dict[str, Any]:
    """f32 inference: the CPU device otherwise runs f32 graphs in bf16 on CPUs that have it (GPU: f16)."""
    if device.split(":")[0] in VIRTUAL_DEVICES:
        return {"INFERENCE_PRECISION_HINT": "f32"}  # not in their SUPPORTED_PROPERTIES, but passed on
    try:
        supported = core().get_property(device, "SUPPORTED_PROPERTIES")
    except RuntimeError:
        supported = {}
    cfg: dict[str, Any] = {}
    if "INFERENCE_PRECISION_HINT" in supported:
        cfg["INFERENCE_PRECISION_HINT"] = "f32"
    if "CPU_DENORMALS_OPTIMIZATION" in supported:
        cfg["CPU_DENORMALS_OPTIMIZATION"] = False  # keep subnormals: tiny scales quantize exactly
    return cfg


def compiled(device: str, key: tuple[Any, ...]) -> ov.CompiledModel:
    """The compiled graph for ``key = (op, *shape_class)``, built and compiled once per process."""
    global compiles
    full = (device, *key)
    with _LOCK:
        cm = _COMPILED.get(full)
        if cm is None:
            op, *args = key
            build: Any = {"store": store_model, "load": load_model, "attention": attention_model}[op]
            cm = core().compile_model(build(*args), device, config(device))
            compiles += 1
            _COMPILED[full] = cm
        return cm


def key(op: str, spec: CacheSpec, n_heads: int = 0) -> tuple[Any, ...]:
    """The compile-cache key of ``op``'s graph for ``spec`` (attention: for ``n_heads`` query heads)."""
    s = spec
    if op == "store":
        return ("store", s.k_format, s.v_format, s.n_kv_heads, s.head_dim)
    if op == "load":
        return ("load", s.k_format, s.v_format, s.n_kv_heads, s.block_size, s.head_dim)
    return ("attention", s.k_format, s.v_format, n_heads, s.n_kv_heads, s.block_size, s.head_dim)


def refusal(device: str, spec: CacheSpec, op: str) -> str | None:
    """Why ``device`` cannot run ``op``'s graph for ``spec``, or None.

    The CPU plugin compiles these graphs for every spec kvhal takes (head_dim 1..4096, block_size 1..128,
    1..8 KV heads, every format: backends/openvino/tests). Other devices' compilers have limits of their
    own, not measurable here, so their graph is compiled now, before anything is allocated, and kept for
    the cache; attention is compiled for one query head per KV head.
    """
    if device.split(".")[0] == "CPU":
        return None
    try:
        compiled(device, key(op, spec, spec.n_kv_heads))
    except RuntimeError as e:
        return f"OpenVINO cannot compile kvhal's {op} graph for device {device}: {compile_error(e)}"
    return None


def compile_error(e: RuntimeError) -> str:
    """OpenVINO's message without its chain of "Exception from <file>:<line>:" prefixes, on one line."""
    text = re.sub(r"Exception from \S+:\d+:\s*", "", " ".join(str(e).split()))
    return text[:400] + ("..." if len(text) > 400 else "")
