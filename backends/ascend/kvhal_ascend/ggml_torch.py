"""kvhal's ggml formats in torch ops: byte-identical to ``kvhal/formats/ggml.py`` on any torch device.

The op set is kept small and ordinary on purpose (abs, amax/amin, div, mul, add, floor, trunc, where,
gather, argmax, cat/stack, dtype casts and same-size/smaller-size ``view``) so that the code means the
same on torch_npu as on the CPU. Every packing step is float arithmetic on small exact integers
(nibbles, bits) instead of bitwise ops, except bf16 rounding, which is integer arithmetic on int32.

Exactness rules mirrored from the numpy spec (the reasons are in kvhal/formats/ggml.py):
* one rounding per operation, in the reference's order (``x*id + 8.5`` is a mul and an add, never an FMA);
* ``id`` is ``1/d`` by true division (``torch.div``, not ``reciprocal``, which devices may approximate),
  and 0 when ``d`` is 0 or its inverse overflows (subnormal ``d``);
* q8_0 rounds half away from zero (``torch.round`` is half-to-even): ``trunc(|v|) + (frac(|v|) >= 0.5)``;
* q4/q5 truncate toward zero; the signed absmax and the min/max are the first occurrence on ties
  (the sign of a zero depends on it), and a zero absmax is +0.0;
* fp16 scales and f16 rows use the device's round-to-nearest-even cast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvhal import formats

QK = 32  # values per ggml block: the nibble and high-bit layouts below are written for it
_Codec = Callable[[torch.Tensor], torch.Tensor]


# ---- helpers -------------------------------------------------------------------------------------


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[nb, 1] f32 -> [nb, 2] uint8, IEEE round to nearest even."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _f16_from(b: torch.Tensor) -> torch.Tensor:
    """[nb, 2] uint8 -> [nb, 1] f32."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    inv = torch.div(torch.ones_like(d), d)
    return torch.where((d == 0) | ~torch.isfinite(inv), torch.zeros_like(inv), inv)


def _first(blocks: torch.Tensor, key: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the value of ``blocks`` at the first position where ``key == target``.

    ggml's scalar loops keep the first of equal candidates, which decides the sign of a zero; argmax's
    tie rule is not a promise every device keeps, so ties are broken by weight (``QK - j``, unique).
    """
    hit = (key == target).to(torch.float32)
    weight = torch.arange(QK, 0, -1, dtype=torch.float32, device=blocks.device)
    return torch.gather(blocks, 1, torch.argmax(hit * weight, dim=1, keepdim=True))


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude with its sign; +0.0 for a zero block (ggml starts from max = 0.0f)."""
    mag = blocks.abs()
    m = _first(blocks, mag, mag.amax(dim=1, keepdim=True))
    return torch.where(m == 0, torch.zeros_like(m), m)


def _first_min_max(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's ``if (v < min) min = v; if (v > max) max = v``: first occurrence, so a zero keeps its sign."""
    lo = _first(blocks, blocks, blocks.amin(dim=1, keepdim=True))
    hi = _first(blocks, blocks, blocks.amax(dim=1, keepdim=True))
    return lo, hi


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[nb, 32] f32 integers 0..15 -> [nb, 16] uint8: value j low nibble, value j+16 high nibble."""
    return (q[:, : QK // 2] + q[:, QK // 2 :] * 16).to(torch.uint8)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 16] uint8 -> [nb, 32] f32."""
    f = qs.to(torch.float32)
    hi = torch.floor(f / 16)
    return torch.cat([f - hi * 16, hi], dim=1)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """[nb, 32] f32 integers 0..31 -> [nb, 4] uint8: bit 4 of value j is bit j of a little-endian u32."""
    bits = (q >= 16).to(torch.float32).view(-1, 4, 8)
    weight = 2.0 ** torch.arange(8, dtype=torch.float32, device=q.device)
    return (bits * weight).sum(dim=2).to(torch.uint8)


def _unpack_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[nb, 4] uint8 -> [nb, 32] f32 of 0/1 (bit j of the little-endian u32)."""
    f = qh.to(torch.float32).unsqueeze(2)
    shifted = torch.floor(f / 2.0 ** torch.arange(9, dtype=torch.float32, device=qh.device))
    return (shifted[..., :8] - 2 * shifted[..., 1:]).reshape(qh.shape[0], QK)


def _low4(q: torch.Tensor) -> torch.Tensor:
    return torch.where(q >= 16, q - 16, q)


# ---- float formats (whole rows: [..., n] <-> [..., n * bytes]) -----------------------------------


def _f32_q(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _f32_dq(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16_q(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _f16_dq(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32)


def _bf16_q(x: torch.Tensor) -> torch.Tensor:
    # ggml's round-to-nearest-even on the top 16 bits, done on the magnitude so int32 never overflows
    # (finite |x| <= 0x7F7FFFFF, plus the bias stays below 2**31); a cast would leave the rounding to
    # the device
    u = x.contiguous().view(torch.int32)
    mag = x.abs().contiguous().view(torch.int32)
    r = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    r = r + (u < 0).to(torch.int32) * 0x8000
    return torch.stack([r & 0xFF, r >> 8], dim=-1).to(torch.uint8).reshape(*x.shape[:-1], -1)


def _bf16_dq(b: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an f32: place the two bytes above two zero bytes and reinterpret
    pairs = b.contiguous().view(*b.shape[:-1], -1, 2)
    zero = torch.zeros_like(pairs)
    return torch.cat([zero, pairs], dim=-1).view(torch.float32).squeeze(-1)


# ---- block formats ([nb, 32] f32 <-> [nb, block_bytes] uint8) ------------------------------------


def _q8_0_q(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(dim=1, keepdim=True) / 127.0
    v = (b * _inverse(d)).abs()
    # C roundf in float32 without floor(|v| + 0.5), whose sum rounds 0.49999997 up to 1: the
    # fractional part v - trunc(v) is exact, so compare it with 0.5 instead
    t = torch.trunc(v)
    r = t + (v - t >= 0.5).to(torch.float32)
    q = torch.where(b < 0, -r, r).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=1)


def _q8_0_dq(b: torch.Tensor) -> torch.Tensor:
    return _f16_from(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).to(torch.float32)


def _q4_0_q(b: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(b) / -8.0
    q = torch.clamp(torch.trunc(b * _inverse(d) + 8.5), max=15)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=1)


def _q4_0_dq(b: torch.Tensor) -> torch.Tensor:
    return _f16_from(b[:, :2]) * (_unpack_nibbles(b[:, 2:]) - 8)


def _q4_1_q(b: torch.Tensor) -> torch.Tensor:
    lo, hi = _first_min_max(b)
    d = (hi - lo) / 15.0
    q = torch.clamp(torch.trunc((b - lo) * _inverse(d) + 0.5), max=15)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], dim=1)


def _q4_1_dq(b: torch.Tensor) -> torch.Tensor:
    return _f16_from(b[:, 0:2]) * _unpack_nibbles(b[:, 4:]) + _f16_from(b[:, 2:4])


def _q5_0_q(b: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(b) / -16.0
    q = torch.clamp(torch.trunc(b * _inverse(d) + 16.5), max=31)
    return torch.cat([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(_low4(q))], dim=1)


def _q5_0_dq(b: torch.Tensor) -> torch.Tensor:
    q = _unpack_nibbles(b[:, 6:]) + _unpack_high_bits(b[:, 2:6]) * 16
    return _f16_from(b[:, :2]) * (q - 16)


def _q5_1_q(b: torch.Tensor) -> torch.Tensor:
    lo, hi = _first_min_max(b)
    d = (hi - lo) / 31.0
    q = torch.clamp(torch.trunc((b - lo) * _inverse(d) + 0.5), max=31)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_high_bits(q), _pack_nibbles(_low4(q))], dim=1)


def _q5_1_dq(b: torch.Tensor) -> torch.Tensor:
    q = _unpack_nibbles(b[:, 8:]) + _unpack_high_bits(b[:, 4:8]) * 16
    return _f16_from(b[:, 0:2]) * q + _f16_from(b[:, 2:4])


# name -> (quantize, dequantize); block sizes come from the format registry (block_len 1: a whole-row float codec)
CODECS: dict[str, tuple[_Codec, _Codec]] = {
    "f32": (_f32_q, _f32_dq),
    "f16": (_f16_q, _f16_dq),
    "bf16": (_bf16_q, _bf16_dq),
    "q8_0": (_q8_0_q, _q8_0_dq),
    "q4_0": (_q4_0_q, _q4_0_dq),
    "q4_1": (_q4_1_q, _q4_1_dq),
    "q5_0": (_q5_0_q, _q5_0_dq),
    "q5_1": (_q5_1_q, _q5_1_dq),
}


def quantize(name: str, x: torch.Tensor) -> torch.Tensor:
    """Float rows ``[..., n]`` (f32/f16/bf16, any device) -> bytes ``[..., row_bytes]`` uint8, same device."""
    f = formats.get(name)
    x = x.to(torch.float32)  # exact for f16/bf16 inputs, as the reference's astype(float32)
    if f.block_len == 1:
        return CODECS[name][0](x)
    n = x.shape[-1]
    out = CODECS[name][0](x.reshape(-1, f.block_len))
    return out.reshape(*x.shape[:-1], n // f.block_len * f.block_bytes)


def dequantize(name: str, b: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., row_bytes]`` uint8 -> f32 rows ``[..., n]``."""
    f = formats.get(name)
    if f.block_len == 1:
        return CODECS[name][1](b)
    nb = b.shape[-1]
    out = CODECS[name][1](b.reshape(-1, f.block_bytes))
    return out.reshape(*b.shape[:-1], nb // f.block_bytes * f.block_len)
