"""ONNX graphs for the arm backend: quantize (store), gather + dequantize (load), paged attention.

Every graph takes the pool as an integer tensor holding the stored bytes: uint8 for the block
formats (int8 for q8_0, whose quants are int8 and whose 2 scale bytes are reinterpreted in-graph),
and a zero-copy uint16/uint32 view of the same bytes for f16/bf16/f32 (their elements are whole IEEE
words, so the graph reinterprets them with BitCast instead of reassembling bytes).
Dequantization is bit ops, Cast and Mul inside the graph; no float copy of a pool ever exists.

Quantization reproduces ``kvhal/formats/ggml.py`` bit for bit with ops whose results IEEE fixes
exactly (Abs, Max/Min, Div, Mul, Add, Floor, Cast f32->f16 which onnxruntime rounds to nearest
even). ONNX has no Trunc and its Round is half-to-even, so:

* q8_0's ``roundf`` (half away from zero) is ``sign(v) * (floor(|v|) + (frac(|v|) >= 0.5))``;
* q4/q5's ``trunc(y)`` is ``clip(floor(y), 0, max)``: ``y`` is ``x*id + 8.5`` (or ``+16.5``/``+0.5``)
  with ``|x*id|`` at most the half range, so ``y > -1`` and floor and trunc agree once clipped at 0;
* block min/max/absmax are the element at the first Arg{Min,Max} index, as ggml's loops choose it
  (which fixes the sign of a zero min/max; an all-zero block's absmax is +0, ggml's starting value).

Dims named ``n``/``nb``/``s``/``mb``/``t``/``mq`` are dynamic: one graph (one session) serves every
token count, batch and context length of its shape class.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvhal import formats

OPSET = 26  # BitCast arrived in opset 26
IR_VERSION = 13  # the IR of opset 26 (onnx 1.21); pinned so a newer onnx does not outrun onnxruntime
QK = 32  # values per ggml block: the nibble and high-bit layouts below are written for it
FLOAT_VIEW: dict[str, np.dtype[Any]] = {
    "f32": np.dtype(np.uint32),
    "f16": np.dtype(np.uint16),
    "bf16": np.dtype(np.uint16),
}
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
FORMATS = (*FLOAT_VIEW, *BLOCK_FORMATS)


def view_dtype(fmt: str) -> np.dtype[Any]:
    """The element type a pool of ``fmt`` is handed to (and written by) the graphs as."""
    return FLOAT_VIEW.get(fmt, np.dtype(np.int8 if fmt == "q8_0" else np.uint8))


class _Builder:
    """Accumulates nodes and constants; every op returns the name of its (single) output."""

    def __init__(self) -> None:
        from onnx import TensorProto, helper, numpy_helper

        self.h, self.T, self.nh = helper, TensorProto, numpy_helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.inputs: list[Any] = []
        self.outputs: list[Any] = []
        self._n = 0
        self._consts: dict[tuple[str, bytes, tuple[int, ...]], str] = {}

    def _name(self, p: str) -> str:
        self._n += 1
        return f"{p}{self._n}"

    def const(self, value: Any, dtype: Any = None) -> str:
        a = np.asarray(value, dtype=dtype)
        key = (a.dtype.str, a.tobytes(), a.shape)
        if key not in self._consts:
            name = self._name("c")
            self.inits.append(self.nh.from_array(a, name))
            self._consts[key] = name
        return self._consts[key]

    def op(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        out = self._name(op_type.lower())
        self.nodes.append(self.h.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def input(self, name: str, dtype: Any, shape: list[Any]) -> str:
        elem = self.h.np_dtype_to_tensor_dtype(np.dtype(dtype))
        self.inputs.append(self.h.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, value: str, name: str, dtype: Any, shape: list[Any]) -> None:
        self.nodes.append(self.h.make_node("Identity", [value], [name]))
        elem = self.h.np_dtype_to_tensor_dtype(np.dtype(dtype))
        self.outputs.append(self.h.make_tensor_value_info(name, elem, shape))

    def model(self, name: str) -> bytes:
        graph = self.h.make_graph(self.nodes, name, self.inputs, self.outputs, self.inits)
        m = self.h.make_model(graph, opset_imports=[self.h.make_opsetid("", OPSET)], ir_version=IR_VERSION)
        data: bytes = m.SerializeToString()
        return data

    # small helpers -------------------------------------------------------------------------------

    def cast(self, x: str, dtype: Any) -> str:
        return self.op("Cast", x, to=self.h.np_dtype_to_tensor_dtype(np.dtype(dtype)))

    def bitcast(self, x: str, dtype: Any) -> str:
        return self.op("BitCast", x, to=self.h.np_dtype_to_tensor_dtype(np.dtype(dtype)))

    def last(self, x: str, a: int, b: int) -> str:
        """``x[..., a:b]``."""
        return self.op("Slice", x, self.const([a], np.int64), self.const([b], np.int64), self.const([-1], np.int64))

    def reshape(self, x: str, shape: list[int]) -> str:
        # 0 copies the input's dim: leading dynamic dims pass through unnamed
        return self.op("Reshape", x, self.const(shape, np.int64))

    def shr(self, x: str, bits: Any, dtype: Any) -> str:
        return self.op("BitShift", x, self.const(bits, dtype), direction="RIGHT")

    def shl(self, x: str, bits: Any, dtype: Any) -> str:
        return self.op("BitShift", x, self.const(bits, dtype), direction="LEFT")


# ---- dequantization: stored elements [lead..., E] -> f32 [lead..., D] ---------------------------------


def _f16_field(g: _Builder, blocks: str, at: int, signed: bool = False) -> str:
    """The little-endian fp16 at byte ``at`` of each block, as f32 ``[..., nblk, 1]``."""
    lo, hi = g.last(blocks, at, at + 1), g.last(blocks, at + 1, at + 2)
    if signed:
        lo, hi = g.bitcast(lo, np.uint8), g.bitcast(hi, np.uint8)
    # int32 arithmetic, not BitShift/BitwiseOr: onnxruntime's bitwise kernels are scalar loops
    # (several times slower than its vectorized Mul/Add), and BitShift has no uint16 kernel in 1.25
    word = g.op("Add", g.cast(lo, np.int32), g.op("Mul", g.cast(hi, np.int32), g.const(256, np.int32)))
    return g.cast(g.bitcast(g.cast(word, np.uint16), np.float16), np.float32)


def _nibbles(g: _Builder, qs: str) -> str:
    """ggml order: value j in the low nibble of byte j, value j+16 in its high nibble."""
    return g.op("Concat", g.op("BitwiseAnd", qs, g.const(15, np.uint8)), g.shr(qs, 4, np.uint8), axis=-1)


def _high_bits(g: _Builder, qh: str, lead: int) -> str:
    """Bit j of the little-endian uint32 ``qh`` as uint8 value j, ``[..., nblk, 32]``."""
    bits = g.op(
        "BitwiseAnd",
        g.shr(g.op("Unsqueeze", qh, g.const([-1], np.int64)), np.arange(8), np.uint8),
        g.const(1, np.uint8),
    )  # [..., nblk, 4, 8]
    return g.reshape(bits, [0] * (lead + 1) + [QK])


def dequantize(g: _Builder, x: str, fmt: str, lead: int, head_dim: int) -> str:
    """``x``: the stored elements of rows ``[lead dims..., E]`` (``view_dtype(fmt)``) -> f32 ``[..., head_dim]``."""
    if fmt == "f32":
        return g.bitcast(x, np.float32)
    if fmt == "f16":
        return g.cast(g.bitcast(x, np.float16), np.float32)
    if fmt == "bf16":  # bf16 is the top half of an f32
        return g.bitcast(g.shl(g.cast(x, np.uint32), 16, np.uint32), np.float32)
    f = formats.get(fmt)
    end = f.block_bytes  # the quants run to the end of each block
    b = g.reshape(x, [0] * lead + [head_dim // f.block_len, end])
    d = _f16_field(g, b, 0, signed=fmt == "q8_0")
    if fmt == "q8_0":
        out = g.op("Mul", d, g.cast(g.last(b, 2, end), np.float32))
    elif fmt == "q4_0":
        q = g.op("Sub", g.cast(_nibbles(g, g.last(b, 2, end)), np.float32), g.const(8, np.float32))
        out = g.op("Mul", d, q)
    elif fmt == "q4_1":
        q = g.cast(_nibbles(g, g.last(b, 4, end)), np.float32)
        out = g.op("Add", g.op("Mul", d, q), _f16_field(g, b, 2))
    elif fmt == "q5_0":
        q5 = g.op("BitwiseOr", _nibbles(g, g.last(b, 6, end)), g.shl(_high_bits(g, g.last(b, 2, 6), lead), 4, np.uint8))
        out = g.op("Mul", d, g.op("Sub", g.cast(q5, np.float32), g.const(16, np.float32)))
    else:  # q5_1
        q5 = g.op("BitwiseOr", _nibbles(g, g.last(b, 8, end)), g.shl(_high_bits(g, g.last(b, 4, 8), lead), 4, np.uint8))
        out = g.op("Add", g.op("Mul", d, g.cast(q5, np.float32)), _f16_field(g, b, 2))
    return g.reshape(out, [0] * lead + [head_dim])


# ---- quantization: f32 [n, H, D] -> stored elements [n, H, E] ----------------------------------------


def _inverse(g: _Builder, d: str) -> str:
    """ggml's ``id = d ? 1/d : 0``, with 0 also where 1/d overflows (as kvhal's reference)."""
    inv = g.op("Div", g.const(1, np.float32), d)
    bad = g.op("Or", g.op("Equal", d, g.const(0, np.float32)), g.op("IsInf", inv))
    return g.op("Where", bad, g.const(0, np.float32), inv)


def _f16_bytes(g: _Builder, x: str) -> str:
    """f32 ``[..., 1]`` -> its fp16 (round to nearest even) as 2 little-endian bytes ``[..., 2]``."""
    u = g.cast(g.bitcast(g.cast(x, np.float16), np.uint16), np.uint32)
    lo = g.cast(g.op("BitwiseAnd", u, g.const(255, np.uint32)), np.uint8)
    return g.op("Concat", lo, g.cast(g.shr(u, 8, np.uint32), np.uint8), axis=-1)


def _trunc_clip(g: _Builder, y: str, top: int) -> str:
    """``min(trunc(y), top)`` as uint8, for ``y > -1`` (see the module docstring)."""
    f = g.op("Floor", y)
    return g.cast(g.op("Clip", f, g.const(0, np.float32), g.const(top, np.float32)), np.uint8)


def _pack_nibbles(g: _Builder, q: str) -> str:
    """Low 4 bits of value j and of j+16 into byte j (the uint8 shift drops value j+16's fifth bit)."""
    lo = g.op("BitwiseAnd", g.last(q, 0, 16), g.const(15, np.uint8))
    return g.op("BitwiseOr", lo, g.shl(g.last(q, 16, 32), 4, np.uint8))


def _pack_high_bits(g: _Builder, q: str) -> str:
    """Fifth bit of the 32 values as the 4 bytes of a little-endian uint32 (bit j = value j)."""
    bits = g.cast(g.reshape(g.shr(q, 4, np.uint8), [0, 0, 0, 4, 8]), np.int32)
    byte = g.op(
        "ReduceSum", g.op("Mul", bits, g.const(1 << np.arange(8), np.int32)), g.const([-1], np.int64), keepdims=0
    )
    return g.cast(byte, np.uint8)


def _first_extreme(g: _Builder, x: str, of: str, op: str) -> str:
    """``x`` at the first index where ``of`` takes its max (ArgMax) or min (ArgMin), as ggml's loops pick it.

    Reduce{Max,Min} would leave the sign of a zero result to the SIMD lane order (+0 and -0 compare
    equal): ggml's ``if (v < min) min = v`` keeps the first one, and so does Arg{Max,Min}.
    """
    idx = g.op(op, of, axis=-1, keepdims=1, select_last_index=0)
    return g.op("GatherElements", x, idx, axis=-1)


def quantize(g: _Builder, x: str, fmt: str, head_dim: int) -> str:
    """f32 ``x [n, H, D]`` -> stored elements ``[n, H, E]`` in ``view_dtype(fmt)``, bit-exact with ggml.py."""
    if fmt == "f32":
        return g.bitcast(x, np.uint32)
    if fmt == "f16":
        return g.bitcast(g.cast(x, np.float16), np.uint16)
    if fmt == "bf16":  # round to nearest even on the upper half; finite inputs cannot carry past 2^32
        u = g.bitcast(x, np.uint32)
        odd = g.op("BitwiseAnd", g.shr(u, 16, np.uint32), g.const(1, np.uint32))
        r = g.op("Add", g.op("Add", u, g.const(0x7FFF, np.uint32)), odd)
        return g.cast(g.shr(r, 16, np.uint32), np.uint16)
    f = formats.get(fmt)
    b = g.reshape(x, [0, 0, head_dim // f.block_len, f.block_len])
    k = g.const([-1], np.int64)
    if fmt == "q8_0":
        d = g.op("Div", g.op("ReduceMax", g.op("Abs", b), k, keepdims=1), g.const(127, np.float32))
        v = g.op("Mul", b, _inverse(g, d))
        # roundf without floor(|v| + 0.5), whose float32 sum rounds 0.49999997 up to 1: the fractional
        # part |v| - floor(|v|) is exact, so compare it with 0.5
        a = g.op("Abs", v)
        t = g.op("Floor", a)
        up = g.cast(g.op("GreaterOrEqual", g.op("Sub", a, t), g.const(0.5, np.float32)), np.float32)
        r = g.op("Mul", g.op("Sign", v), g.op("Add", t, up))
        parts = [g.bitcast(_f16_bytes(g, d), np.int8), g.cast(r, np.int8)]
    elif fmt in ("q4_0", "q5_0"):
        half = 8 if fmt == "q4_0" else 16
        m = _first_extreme(g, b, g.op("Abs", b), "ArgMax")
        # ggml starts from max = 0.0f and replaces it only on a larger |v|: an all-zero block keeps +0
        m = g.op("Where", g.op("Equal", m, g.const(0, np.float32)), g.const(0, np.float32), m)
        d = g.op("Div", m, g.const(-half, np.float32))
        y = g.op("Add", g.op("Mul", b, _inverse(g, d)), g.const(half + 0.5, np.float32))
        q = _trunc_clip(g, y, 2 * half - 1)
        parts = [_f16_bytes(g, d)] + ([_pack_high_bits(g, q)] if fmt == "q5_0" else []) + [_pack_nibbles(g, q)]
    else:  # q4_1, q5_1
        top = 15 if fmt == "q4_1" else 31
        lo = _first_extreme(g, b, b, "ArgMin")
        d = g.op("Div", g.op("Sub", _first_extreme(g, b, b, "ArgMax"), lo), g.const(top, np.float32))
        y = g.op("Add", g.op("Mul", g.op("Sub", b, lo), _inverse(g, d)), g.const(0.5, np.float32))
        q = _trunc_clip(g, y, top)
        parts = [_f16_bytes(g, d), _f16_bytes(g, lo)]
        parts += ([_pack_high_bits(g, q)] if fmt == "q5_1" else []) + [_pack_nibbles(g, q)]
    return g.reshape(g.op("Concat", *parts, axis=-1), [0, 0, -1])


# ---- whole graphs ------------------------------------------------------------------------------------


def row_elems(fmt: str, head_dim: int) -> int:
    """Elements of one stored row in ``view_dtype(fmt)``."""
    return formats.get(fmt).row_bytes(head_dim) // view_dtype(fmt).itemsize


def store_graph(k_fmt: str, v_fmt: str, n_kv_heads: int, head_dim: int) -> bytes:
    """k, v f32 ``[n, H, D]`` -> ``k_rows``/``v_rows`` ``[n, H, E]``; the host scatters them into the pool."""
    g = _Builder()
    for name, fmt in (("k", k_fmt), ("v", v_fmt)):
        x = g.input(name, np.float32, ["n", n_kv_heads, head_dim])
        g.output(
            quantize(g, x, fmt, head_dim), f"{name}_rows", view_dtype(fmt), ["n", n_kv_heads, row_elems(fmt, head_dim)]
        )
    return g.model("kvhal_arm_store")


def load_graph(k_fmt: str, v_fmt: str, n_kv_heads: int, block_size: int, head_dim: int) -> bytes:
    """Pools + ``block_ids [nb]`` + ``n [1]`` -> the first n tokens of those pages, f32 ``[n, H, D]``."""
    g = _Builder()
    ids = g.input("block_ids", np.int64, ["nb"])
    n = g.input("n", np.int64, [1])
    for name, fmt in (("k", k_fmt), ("v", v_fmt)):
        e = row_elems(fmt, head_dim)
        pool = g.input(f"{name}_pool", view_dtype(fmt), ["blocks", n_kv_heads, block_size, e])
        pages = g.op("Transpose", g.op("Gather", pool, ids, axis=0), perm=[0, 2, 1, 3])  # [nb, bs, H, E]
        rows = g.op("Slice", g.reshape(pages, [-1, n_kv_heads, e]), g.const([0], np.int64), n, g.const([0], np.int64))
        g.output(dequantize(g, rows, fmt, 2, head_dim), name, np.float32, ["n", n_kv_heads, head_dim])
    return g.model("kvhal_arm_load")


def attention_graph(k_fmt: str, v_fmt: str, n_heads: int, n_kv_heads: int, block_size: int, head_dim: int) -> bytes:
    """Paged attention over the quantized pools for a padded batch of sequences, in one run.

    Inputs (host-prepared, tiny): ``q [t, Hq, D]``; ``block_table [s, mb]`` (-1 padded); ``seq_lens [s]``;
    ``q_index [s, mq]`` the row in q of each (padded) query; ``pos [s, mq*group]`` its position, repeated
    for the query heads of one KV head (the row order of the score matrix); ``out_index [t]`` the padded
    row of each real query; ``scale``, ``causal``, ``window`` scalars (window 2^62 = none).
    Pages are gathered, dequantized and attended inside the graph; padded queries are dropped by out_index.
    """
    g = _Builder()
    group = n_heads // n_kv_heads
    q = g.input("q", np.float32, ["t", n_heads, head_dim])
    table = g.input("block_table", np.int32, ["s", "mb"])
    seq_lens = g.input("seq_lens", np.int64, ["s"])
    q_index = g.input("q_index", np.int64, ["s", "mq"])
    pos = g.input("pos", np.int64, ["s", "rows"])
    out_index = g.input("out_index", np.int64, ["t"])
    scale = g.input("scale", np.float32, [])
    causal = g.input("causal", np.bool_, [])
    window = g.input("window", np.int64, [])
    pages = g.op("Max", table, g.const(0, np.int32))  # -1 padding reads page 0; the mask hides it
    kv = []
    for name, fmt in (("k", k_fmt), ("v", v_fmt)):
        e = row_elems(fmt, head_dim)
        pool = g.input(f"{name}_pool", view_dtype(fmt), ["blocks", n_kv_heads, block_size, e])
        x = g.op("Transpose", g.op("Gather", pool, pages, axis=0), perm=[0, 2, 1, 3, 4])  # [s, H, mb, bs, E]
        x = g.reshape(x, [0, 0, -1, e])  # [s, H, L, E]
        kv.append(dequantize(g, x, fmt, 3, head_dim))  # [s, H, L, D]
    k, v = kv
    # queries [s, mq, Hq, D] -> [s, Hkv, mq*group, D]: each KV head meets its query group in one matmul
    qs = g.op("Mul", g.op("Gather", q, q_index, axis=0), scale)
    qs = g.op("Transpose", g.reshape(qs, [0, 0, n_kv_heads, group, head_dim]), perm=[0, 2, 1, 3, 4])
    qs = g.reshape(qs, [0, 0, -1, head_dim])
    scores = g.op("MatMul", qs, g.op("Transpose", k, perm=[0, 1, 3, 2]))  # [s, Hkv, mq*group, L]
    # visibility [s, mq*group, L]: j < seq_len, j <= pos when causal, j > pos - window
    length = g.op("Gather", g.op("Shape", k), g.const(2, np.int64), axis=0)
    j = g.op("Range", g.const(0, np.int64), length, g.const(1, np.int64))
    p = g.op("Unsqueeze", pos, g.const([-1], np.int64))  # [s, rows, 1]
    inside = g.op("Less", j, g.op("Unsqueeze", seq_lens, g.const([1, 2], np.int64)))
    past = g.op("Or", g.op("Not", causal), g.op("LessOrEqual", j, p))
    recent = g.op("Greater", j, g.op("Sub", p, window))
    visible = g.op("And", g.op("And", inside, past), recent)
    visible = g.op("Unsqueeze", visible, g.const([1], np.int64))  # [s, 1, rows, L]
    masked = g.op("Where", visible, scores, g.const(-np.inf, np.float32))
    probs = g.op("Softmax", masked, axis=-1)
    out = g.op("MatMul", probs, v)  # [s, Hkv, mq*group, D]
    out = g.op("Transpose", g.reshape(out, [0, 0, -1, group, head_dim]), perm=[0, 2, 1, 3, 4])
    out = g.op("Gather", g.reshape(out, [-1, n_heads, head_dim]), out_index, axis=0)
    g.output(out, "out", np.float32, ["t", n_heads, head_dim])
    return g.model("kvhal_arm_attention")
