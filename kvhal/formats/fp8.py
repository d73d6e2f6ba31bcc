"""fp8 formats: OCP ``e4m3fn`` and ``e5m2``, one byte per value, no block scale.

The conversion is round to nearest even, saturating: a value beyond the format's largest finite
value stores that value (vLLM's practice; ``torch``/``ml_dtypes`` produce NaN or inf there). For
every value within range the byte equals ``torch.float8_e4m3fn`` / ``float8_e5m2`` conversion.
A cache scales values into range with ``k_scale``/``v_scale`` (``stored = x / scale``).
"""

from __future__ import annotations

import numpy as np

from . import Format, register


class _Fp8:
    """Sign, ``exp_bits`` exponent bits with ``bias``, ``man_bits`` mantissa bits; subnormals at exponent 0."""

    def __init__(self, exp_bits: int, man_bits: int, max_finite: float) -> None:
        self.man_bits = man_bits
        self.bias = (1 << (exp_bits - 1)) - 1
        self.min_exp = 1 - self.bias  # exponent of the smallest normal
        self.max_finite = max_finite
        codes = np.arange(256, dtype=np.uint16)
        self.table = np.array([self._decode(int(c)) for c in codes], dtype=np.float32)

    def _decode(self, code: int) -> float:
        sign = -1.0 if code & 0x80 else 1.0
        e = (code & 0x7F) >> self.man_bits
        m = code & ((1 << self.man_bits) - 1)
        if e == 0:
            return sign * m * 2.0 ** (self.min_exp - self.man_bits)
        value = (1 + m / (1 << self.man_bits)) * 2.0 ** (e - self.bias)
        return sign * value if value <= self.max_finite else float("nan")  # inf/NaN codes: never stored

    def encode(self, x: np.ndarray) -> np.ndarray:
        a = np.minimum(np.abs(x.astype(np.float64)), self.max_finite)
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
        e = np.maximum(e, self.min_exp)  # subnormals share the smallest normal's quantum
        quantum = np.exp2(e - self.man_bits)
        r = np.rint(a / quantum) * quantum  # exact division by a power of two; rint is half-to-even
        r = np.minimum(r, self.max_finite)
        er = np.floor(np.log2(np.where(r > 0, r, 1.0)))
        normal = er >= self.min_exp
        mant_sub = np.rint(r / 2.0 ** (self.min_exp - self.man_bits))
        mant_norm = np.rint(r / np.exp2(er - self.man_bits)) - (1 << self.man_bits)
        exp_field = np.where(normal, er + self.bias, 0)
        mant = np.where(normal, mant_norm, mant_sub)
        code = (exp_field.astype(np.int64) << self.man_bits) | mant.astype(np.int64)
        code = np.where(r == 0, 0, code)
        sign = np.signbit(x).astype(np.int64)  # kept when the value rounds to zero: -0.0, as IEEE rounding
        return (code | (sign << 7)).astype(np.uint8)

    def decode(self, b: np.ndarray) -> np.ndarray:
        return self.table[b]

    def round(self, x: np.ndarray) -> np.ndarray:
        """``decode(encode(x))`` for finite f32 ``x``, ~10x faster (f32 bit moves instead of float64 logs): the
        values a cache would read back, for calibration to compare candidate scales on."""
        a = np.minimum(np.abs(np.asarray(x, np.float32)), np.float32(self.max_finite))
        u = a.view(np.uint32)
        sh = 23 - self.man_bits  # normals: round the f32 mantissa to man_bits, half to even
        r = ((u + np.uint32((1 << (sh - 1)) - 1) + ((u >> sh) & np.uint32(1))) & ~np.uint32((1 << sh) - 1)).view(
            np.float32
        )
        quantum = np.float32(2.0 ** (self.min_exp - self.man_bits))  # subnormals: multiples of the smallest one
        r = np.where(a < np.float32(2.0**self.min_exp), np.rint(a / quantum) * quantum, r)
        return np.copysign(np.minimum(r, np.float32(self.max_finite)), x).astype(np.float32)


_E4M3 = _Fp8(4, 3, 448.0)
_E5M2 = _Fp8(5, 2, 57344.0)

FP8_E4M3 = register(
    Format(
        "fp8_e4m3",
        1,
        1,
        _E4M3.max_finite,
        lambda b: _E4M3.encode(b).reshape(b.shape[0], 1),
        lambda b: _E4M3.decode(b).reshape(b.shape[0], 1),
        None,
        saturates=True,
        calibration_max=_E4M3.max_finite,
        round_values=_E4M3.round,
    )
)
FP8_E5M2 = register(
    Format(
        "fp8_e5m2",
        1,
        1,
        _E5M2.max_finite,
        lambda b: _E5M2.encode(b).reshape(b.shape[0], 1),
        lambda b: _E5M2.decode(b).reshape(b.shape[0], 1),
        None,
        saturates=True,
        calibration_max=_E5M2.max_finite,
        round_values=_E5M2.round,
    )
)
