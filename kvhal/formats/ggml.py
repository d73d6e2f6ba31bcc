"""ggml's KV formats, byte-identical to ``ggml-quants.c`` reference quantizers (the spec, in numpy).

Every quantized block is 32 values with an fp16 scale ``d`` (and an fp16 min ``m`` for the ``_1``
formats). As in ggml, values are multiplied by the fp32 inverse of the *unrounded* scale, while
dequantization uses the fp16 scale. q8_0 rounds half away from zero (C ``roundf``); q4/q5 truncate
``x*id + 8.5`` (``+16.5``, and ``+0.5`` for the min/max formats). A 4-bit block stores value j in
the low nibble and value j+16 in the high nibble of byte j; q5 keeps the fifth bits in a
little-endian uint32 ``qh`` (bit j for value j).
"""

from __future__ import annotations

import numpy as np

from . import Format, register

QK = 32  # values per quantized block
F16_MAX = float(np.finfo(np.float16).max)
# bf16 has f32's exponent; values above this round to inf
BF16_MAX = float(np.frombuffer(np.uint32(0x7F7F7FFF).tobytes(), np.float32)[0])


def round_f16(x: np.ndarray) -> np.ndarray:
    """``x.astype(float16).astype(float32)`` for finite f32 ``|x| <= F16_MAX``, bit for bit, in vectorized
    integer steps (numpy's float16 casts run a scalar loop, ~6 ns a value): round to nearest even at f16's
    10 mantissa bits (on the bits, sign included: no carry reaches it below F16_MAX), and to a multiple of
    2**-24 below 2**-14, f16's subnormals."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.view(np.uint32)
    r = b >> np.uint32(13)
    r &= np.uint32(1)
    r += b
    r += np.uint32(0x0FFF)
    r &= np.uint32(0xFFFFE000)
    out = r.view(np.float32)
    small = np.flatnonzero(np.abs(x) < np.float32(2.0**-14))
    if small.size:
        xs = x.reshape(-1)[small]
        out.reshape(-1)[small] = np.rint(xs * np.float32(2.0**24)) * np.float32(2.0**-24)
    return out


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(a.shape[0], 2)


def _f16_from(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    """ggml's ``id = d ? 1/d : 0``; a subnormal ``d`` whose inverse overflows also gets 0.

    Such a block's fp16 scale rounds to 0, so it dequantizes to zeros either way; taking 0 keeps the
    quants defined (ggml would cast inf to int8, which C leaves undefined).
    """
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.float32(1.0) / d
    return np.where((d == 0) | ~np.isfinite(inv), np.float32(0), inv).astype(np.float32)


def _roundf(x: np.ndarray) -> np.ndarray:
    """C ``roundf``: round half away from zero.

    The ``+ 0.5`` is done in float64: in float32, 0.49999997 + 0.5 rounds up to 1.0.
    """
    return np.copysign(np.floor(np.abs(x).astype(np.float64) + 0.5), x).astype(np.float32)


def _signed_absmax(blocks: np.ndarray) -> np.ndarray:
    """The value of largest magnitude with its sign, first occurrence on ties (ggml's q4_0/q5_0).

    ggml starts from ``max = 0.0f`` and replaces it only on a strictly larger ``|v|``, so an all-zero
    block keeps +0.0 even when its values are -0.0.
    """
    idx = np.abs(blocks).argmax(axis=1)[:, None]
    m = np.take_along_axis(blocks, idx, axis=1)
    return np.where(m == 0, np.float32(0), m)


def _first_min_max(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``if (v < min) min = v; if (v > max) max = v``: the first occurrence wins ties.

    That decides the sign of a zero min/max (and so the bytes of ``d`` and ``m``) in blocks holding
    both 0.0 and -0.0, where numpy's ``min``/``max`` may return either.
    """
    lo = np.take_along_axis(blocks, blocks.argmin(axis=1)[:, None], axis=1)
    hi = np.take_along_axis(blocks, blocks.argmax(axis=1)[:, None], axis=1)
    return lo, hi


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Value j in the low nibble and value j+16 in the high nibble of byte j."""
    return (q[:, : QK // 2] & 0x0F) | ((q[:, QK // 2 :] & 0x0F) << 4)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """The fifth bit of each of 32 values as a little-endian uint32 (bit j = value j)."""
    bits = ((q >> 4) & 1).astype(np.uint32)
    qh = (bits << np.arange(QK, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return qh.astype("<u4").view(np.uint8).reshape(-1, 4)


def _unpack_high_bits(qh: np.ndarray) -> np.ndarray:
    word = np.ascontiguousarray(qh).view("<u4")  # [nb, 1]
    return ((word >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)


# ---- float formats -------------------------------------------------------------------------------


def _f32_q(b: np.ndarray) -> np.ndarray:
    return b.astype("<f4").view(np.uint8).reshape(b.shape[0], 4)


def _f32_dq(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f4").reshape(b.shape[0], 1).astype(np.float32)


def _f16_q(b: np.ndarray) -> np.ndarray:
    return _f16_bytes(b)  # IEEE round to nearest even, as ggml's F16C path


def _f16_dq(b: np.ndarray) -> np.ndarray:
    return _f16_from(b).reshape(b.shape[0], 1)


def _bf16_q(b: np.ndarray) -> np.ndarray:
    # ggml_compute_fp32_to_bf16: round to nearest even on the upper 16 bits (inputs are finite here)
    u = np.ascontiguousarray(b, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    return r.view(np.uint8).reshape(b.shape[0], 2)


def _bf16_dq(b: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16
    return u.view(np.float32).reshape(b.shape[0], 1)


# ---- q8_0: {f16 d; int8 qs[32]} ------------------------------------------------------------------


def _q8_0_q(b: np.ndarray) -> np.ndarray:
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    q = _roundf(b * _inverse(d)).astype(np.int8)
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)


def _q8_0_dq(b: np.ndarray) -> np.ndarray:
    d = _f16_from(b[:, :2])
    return d * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)


# ---- q4_0: {f16 d; u8 qs[16]} --------------------------------------------------------------------


def _q4_0_q(b: np.ndarray) -> np.ndarray:
    d = _signed_absmax(b) / np.float32(-8)
    q = np.minimum(np.trunc(b * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1)


def _q4_0_dq(b: np.ndarray) -> np.ndarray:
    return _f16_from(b[:, :2]) * (_unpack_nibbles(b[:, 2:]).astype(np.float32) - 8)


# ---- q4_1: {f16 d; f16 m; u8 qs[16]} -------------------------------------------------------------


def _q4_1_q(b: np.ndarray) -> np.ndarray:
    lo, hi = _first_min_max(b)
    d = (hi - lo) / np.float32(15)
    q = np.minimum(np.trunc((b - lo) * _inverse(d) + np.float32(0.5)), 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=1)


def _q4_1_dq(b: np.ndarray) -> np.ndarray:
    d, m = _f16_from(b[:, 0:2]), _f16_from(b[:, 2:4])
    return d * _unpack_nibbles(b[:, 4:]).astype(np.float32) + m


# ---- q5_0: {f16 d; u32 qh; u8 qs[16]} ------------------------------------------------------------


def _q5_0_q(b: np.ndarray) -> np.ndarray:
    d = _signed_absmax(b) / np.float32(-16)
    q = np.minimum(np.trunc(b * _inverse(d) + np.float32(16.5)), 31).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], axis=1)


def _q5_0_dq(b: np.ndarray) -> np.ndarray:
    q = _unpack_nibbles(b[:, 6:]) | (_unpack_high_bits(b[:, 2:6]) << 4)
    return _f16_from(b[:, :2]) * (q.astype(np.float32) - 16)


# ---- q5_1: {f16 d; f16 m; u32 qh; u8 qs[16]} -----------------------------------------------------


def _q5_1_q(b: np.ndarray) -> np.ndarray:
    lo, hi = _first_min_max(b)
    d = (hi - lo) / np.float32(31)
    q = np.minimum(np.trunc((b - lo) * _inverse(d) + np.float32(0.5)), 31).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_high_bits(q), _pack_nibbles(q)], axis=1)


def _q5_1_dq(b: np.ndarray) -> np.ndarray:
    d, m = _f16_from(b[:, 0:2]), _f16_from(b[:, 2:4])
    q = _unpack_nibbles(b[:, 8:]) | (_unpack_high_bits(b[:, 4:8]) << 4)
    return d * q.astype(np.float32) + m


F32 = register(Format("f32", 1, 4, float(np.finfo(np.float32).max), _f32_q, _f32_dq, "F32"))
F16 = register(Format("f16", 1, 2, F16_MAX, _f16_q, _f16_dq, "F16"))
BF16 = register(Format("bf16", 1, 2, BF16_MAX, _bf16_q, _bf16_dq, "BF16"))
Q8_0 = register(Format("q8_0", QK, 34, F16_MAX, _q8_0_q, _q8_0_dq, "Q8_0"))
Q4_0 = register(Format("q4_0", QK, 18, F16_MAX, _q4_0_q, _q4_0_dq, "Q4_0"))
Q4_1 = register(Format("q4_1", QK, 20, F16_MAX, _q4_1_q, _q4_1_dq, "Q4_1"))
Q5_0 = register(Format("q5_0", QK, 22, F16_MAX, _q5_0_q, _q5_0_dq, "Q5_0"))
Q5_1 = register(Format("q5_1", QK, 24, F16_MAX, _q5_1_q, _q5_1_dq, "Q5_1"))
