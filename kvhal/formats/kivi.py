"""KIVI-style asymmetric formats: K per channel over the tokens of a page, V per token.

``kivi4`` / ``kivi2`` store b-bit codes ``q = trunc((x - min) / d + 0.5)`` clipped to ``2^b - 1`` with
``d = (max - min) / (2^b - 1)`` and ``x ~ d*q + min`` (ggml's q4_1 rule).

- V (and this format's plain rows): per token, groups of 32 values ``{f16 d; f16 m; u8 qs[32*b/8]}``.
  ``kivi4`` rows are byte-identical to ggml's ``q4_1`` (5 bits per value); ``kivi2`` packs value
  j + 8i into bits 2i..2i+1 of byte j (3 bits per value).
- K: per channel over the ``bs`` tokens of one page of one KV head: ``bs`` rows of codes (packed as the
  V rows, without scales) then ``f16 d[n]`` and ``f16 m[n]``; ``bs*n*b/8 + 4n`` bytes, ``b + 32/bs``
  bits per value. A K page is quantized once, when its last token arrives; until then its tokens
  live in the cache's f16 tail.
"""

from __future__ import annotations

import numpy as np

from . import Format, KPageCodec, register
from .ggml import F16_MAX, _f16_bytes, _first_min_max, _inverse, _q4_1_dq, _q4_1_q


def _codes(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    top = (1 << bits) - 1
    d = (hi - lo) / np.float32(top)
    q = np.minimum(np.trunc((x - lo) * _inverse(d) + np.float32(0.5)), top).astype(np.uint8)
    return d, q


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[rows, 32k] codes -> [rows, 4k*bits] bytes; per 32-group, value j + (32/per)*i in field i of byte j."""
    per = 8 // bits  # values per byte
    g = q.reshape(q.shape[0], q.shape[1] // 32, per, 32 // per)  # [rows, groups, field, byte]; no -1: 0 rows
    shifts = (np.arange(per, dtype=np.uint8) * bits)[None, None, :, None]
    return np.bitwise_or.reduce(g << shifts, axis=2).reshape(q.shape[0], q.shape[1] // per).astype(np.uint8)


def _unpack(b: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    g = b.reshape(b.shape[0], b.shape[1] * per // 32, 1, 32 // per)  # explicit: -1 fails on 0 rows
    shifts = (np.arange(per, dtype=np.uint8) * bits)[None, None, :, None]
    return ((g >> shifts) & ((1 << bits) - 1)).reshape(b.shape[0], b.shape[1] * per)


def _kivi2_q(b: np.ndarray) -> np.ndarray:
    lo, hi = _first_min_max(b)
    d, q = _codes(b, lo, hi, 2)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack(q, 2)], axis=1)


def _kivi2_dq(b: np.ndarray) -> np.ndarray:
    d = np.ascontiguousarray(b[:, 0:2]).view(np.float16).astype(np.float32)
    m = np.ascontiguousarray(b[:, 2:4]).view(np.float16).astype(np.float32)
    return d * _unpack(b[:, 4:], 2).astype(np.float32) + m


def _page_codec(bits: int) -> KPageCodec:
    def quantize_page(pages: np.ndarray) -> np.ndarray:
        p, bs, n = pages.shape
        by_channel = np.ascontiguousarray(pages.transpose(0, 2, 1)).reshape(p * n, bs)
        lo, hi = _first_min_max(by_channel)  # [p*n, 1]
        d, q = _codes(by_channel, lo, hi, bits)
        codes = q.reshape(p, n, bs).transpose(0, 2, 1).reshape(p * bs, n)
        rows = _pack(codes, bits).reshape(p, bs * n * bits // 8)
        scales = np.concatenate([_f16_bytes(d).reshape(p, 2 * n), _f16_bytes(lo).reshape(p, 2 * n)], axis=1)
        return np.concatenate([rows, scales], axis=1)

    def dequantize_page(data: np.ndarray, bs: int) -> np.ndarray:
        p = data.shape[0]
        n = data.shape[1] * 8 // (bs * bits + 32)  # bytes = bs*n*bits/8 + 4n
        code_bytes = bs * n * bits // 8
        codes = _unpack(np.ascontiguousarray(data[:, :code_bytes]).reshape(p * bs, -1), bits).reshape(p, bs, n)
        d = np.ascontiguousarray(data[:, code_bytes : code_bytes + 2 * n]).view(np.float16).astype(np.float32)
        m = np.ascontiguousarray(data[:, code_bytes + 2 * n :]).view(np.float16).astype(np.float32)
        return d[:, None, :] * codes.astype(np.float32) + m[:, None, :]

    return KPageCodec(bits, quantize_page, dequantize_page)


KIVI4 = register(Format("kivi4", 32, 20, F16_MAX, _q4_1_q, _q4_1_dq, None, k_page=_page_codec(4)))
KIVI2 = register(Format("kivi2", 32, 12, F16_MAX, _kivi2_q, _kivi2_dq, None, k_page=_page_codec(2)))
