"""4-bit float formats (e2m1 values with a shared scale), byte-identical to ggml's ``block_mxfp4`` and
``block_nvfp4``.

A code is an index into the e2m1 values doubled, ``{0, 1, 2, 3, 4, 6, 8, 12}`` and their negatives
(codes 8-15); the block scale carries the halving, as in ggml. Each value takes the code nearest to
``x / d``, the lowest code on ties (ggml's ``best_index_mxfp4``).

- ``mxfp4`` (OCP MX): 32 values, ``{u8 e; u8 qs[16]}``; ``e`` is an e8m0 exponent,
  ``floor(log2(amax)) - 2 + 127``, and ``d = 2^(e-127) / 2``; value j in the low nibble and value
  j+16 in the high nibble of byte j. 4.25 bits per value.
- ``nvfp4``: 64 values in four sub-blocks of 16, ``{u8 d[4]; u8 qs[32]}``; ``d[s]`` is an unsigned
  e4m3 scale, ``ue4m3(amax_s / 6)``, decoded with ggml's factor of one half; sub-block s keeps value j
  in the low nibble and j+8 in the high nibble of ``qs[8s + j]``. 4.5 bits per value. The scale
  saturates at 448, so values beyond 6 * 448 store 2688: a cache scale (``k_scale``/``v_scale``) is the
  per-tensor scale that brings values into range.
"""

from __future__ import annotations

import numpy as np

from . import Format, register

E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def _nearest_code(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Index of the code nearest to x, lowest on ties; ``x`` [..., n], ``d`` broadcast to it."""
    errs = np.abs(d[..., None] * E2M1_DOUBLED - x[..., None])
    return errs.argmin(axis=-1).astype(np.uint8)


# ---- mxfp4 ---------------------------------------------------------------------------------------


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: 2^(e-127) / 2, with the subnormal f32 bit patterns for e < 2."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def _mxfp4_q(b: np.ndarray) -> np.ndarray:
    amax = np.abs(b).max(axis=1)
    with np.errstate(divide="ignore"):
        # clipped at 0: below 2^-125 ggml's uint8 cast of a negative exponent is undefined; d is then
        # the smallest scale (2^-128), on which the block's values are coded
        e = np.clip(np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0), 0, 254).astype(np.uint8)
    codes = _nearest_code(b, np.broadcast_to(_e8m0_half(e)[:, None], b.shape))
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return np.concatenate([e[:, None], qs], axis=1)


def _mxfp4_dq(b: np.ndarray) -> np.ndarray:
    d = _e8m0_half(b[:, 0])[:, None]
    qs = b[:, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return d * E2M1_DOUBLED[codes]


# ---- nvfp4 ---------------------------------------------------------------------------------------


def _ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3: non-negative f32 -> unsigned e4m3 code, round half up on the first dropped
    bit, saturating at 0x7E (448); 0x7F is never produced."""
    x = np.clip(x, 0.0, 448.0).astype(np.float32)
    bits = x.view(np.uint32)
    exp = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + 7
    man = ((bits >> 20) & 0x7).astype(np.int32) + ((bits >> 19) & 1).astype(np.int32)
    carry = man > 7
    man = np.where(carry, 0, man)
    exp_r = np.where(carry, exp + 1, exp)
    normal = np.where(exp_r >= 15, 0x7E, (exp_r << 3) | man)
    sub = np.clip((x * np.float32(512.0) + np.float32(0.5)).astype(np.int32), 0, 7)
    code = np.where(exp <= 0, sub, np.where(exp >= 15, 0x7E, normal))
    return np.where(x <= 0, 0, code).astype(np.uint8)


def _ue4m3_half(code: np.ndarray) -> np.ndarray:
    """ggml_ue4m3_to_fp32: the e4m3 value times one half (0 and 0x7F decode to 0)."""
    c = code.astype(np.int32)
    exp, man = (c >> 3) & 0xF, (c & 7).astype(np.float32)
    raw = np.where(exp == 0, man * np.float32(2.0**-9), (1 + man / 8) * np.exp2(exp.astype(np.float32) - 7))
    return np.where((c == 0) | (c == 0x7F), 0, raw * np.float32(0.5)).astype(np.float32)


def _nvfp4_q(b: np.ndarray) -> np.ndarray:
    sub = b.reshape(-1, 4, 16)
    amax = np.abs(sub).max(axis=2)
    scale = _ue4m3(amax / np.float32(6.0))  # [nb, 4]
    codes = _nearest_code(sub, np.broadcast_to(_ue4m3_half(scale)[..., None], sub.shape))
    qs = (codes[..., :8] | (codes[..., 8:] << 4)).reshape(-1, 32)
    return np.concatenate([scale, qs], axis=1)


def _nvfp4_dq(b: np.ndarray) -> np.ndarray:
    d = _ue4m3_half(b[:, :4])[..., None]  # [nb, 4, 1]
    qs = b[:, 4:].reshape(-1, 4, 8)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
    return (d * E2M1_DOUBLED[codes]).reshape(-1, 64)


_F32_MAX = float(np.finfo(np.float32).max)
MXFP4 = register(Format("mxfp4", 32, 17, _F32_MAX, _mxfp4_q, _mxfp4_dq, "MXFP4"))
NVFP4 = register(
    Format("nvfp4", 64, 36, 6.0 * 448.0, _nvfp4_q, _nvfp4_dq, "NVFP4", saturates=True, calibration_max=6.0 * 448.0)
)
