"""Formats v2 against independent oracles: torch and ml_dtypes for fp8, the gguf package for mxfp4,
nvfp4 and kivi4's V rows, and literal per-value loops for what no library has (nvfp4's quantizer,
kivi2, the per-channel K pages)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import quants

import kvhal
from kvhal import formats


def fp8_cases(rng: np.random.Generator, top: float, tiny: float) -> np.ndarray:
    """Random values over the whole range, subnormals, exact ties between neighbours, the limits."""
    e = rng.uniform(np.log2(tiny) - 3, np.log2(top), 4096)
    x = np.exp2(e) * rng.choice([-1, 1], 4096)
    codes = np.arange(0, 0x7F, dtype=np.uint8)
    dtype = ml_dtypes.float8_e4m3fn if top == 448 else ml_dtypes.float8_e5m2
    vals = codes.view(dtype).astype(np.float64)
    vals = vals[np.isfinite(vals)]
    mids = (vals[:-1] + vals[1:]) / 2  # halfway: round to the even code
    edge = [0.0, -0.0, top, -top, tiny, -tiny, tiny / 2, tiny / 4, top * 0.999]
    return np.concatenate([x, mids, -mids, vals, edge]).astype(np.float32)


@pytest.mark.parametrize(
    ("name", "dtype", "tdtype", "top", "tiny"),
    [
        ("fp8_e4m3", ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn, 448.0, 2.0**-9),
        ("fp8_e5m2", ml_dtypes.float8_e5m2, torch.float8_e5m2, 57344.0, 2.0**-16),
    ],
)
def test_fp8_bytes_match_torch_and_ml_dtypes(name, dtype, tdtype, top, tiny):
    x = fp8_cases(np.random.default_rng(0), top, tiny)
    f = formats.get(name)
    got = f.quantize(x[None])[0]
    np.testing.assert_array_equal(got, x.astype(dtype).view(np.uint8))
    np.testing.assert_array_equal(got, torch.from_numpy(x).to(tdtype).view(torch.uint8).numpy())
    np.testing.assert_array_equal(f.dequantize(got[None])[0], got.view(dtype).astype(np.float32))
    assert f.bits_per_element == 8
    # the fast read-back that calibration searches scales with: the same values, signed zeros included
    back = f.round_values(x)
    np.testing.assert_array_equal(back, x.astype(dtype).astype(np.float32))
    np.testing.assert_array_equal(np.signbit(back), np.signbit(x.astype(dtype).astype(np.float32)))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
def test_saturating_formats_store_their_largest_value(name):
    f = formats.get(name)
    x = np.full((1, 64), f.max_abs * 10, np.float32)
    x[0, 1::2] *= -1
    y = f.dequantize(f.quantize(x))
    np.testing.assert_array_equal(np.abs(y), f.max_abs)
    assert np.array_equal(np.sign(y), np.sign(x))
    if f.round_values is not None:
        np.testing.assert_array_equal(f.round_values(x), y)
    with pytest.raises(kvhal.NonFiniteError):
        f.quantize(np.full((1, 64), np.inf, np.float32))


def fp4_inputs(rng: np.random.Generator, n: int) -> np.ndarray:
    rows = [
        rng.standard_normal(n),
        np.zeros(n),
        rng.standard_normal(n) * rng.uniform(1e-3, 1e3),
        np.r_[rng.standard_normal(n - 1) * 1e-2, 300.0],  # an outlier
        np.resize(
            np.r_[0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25], n
        ),  # ties
        rng.uniform(-1, 1, n) * 1e-6,
        np.full(n, -0.0),
    ]
    return np.asarray(rows, np.float32)


def test_mxfp4_bytes_match_gguf():
    rng = np.random.default_rng(1)
    x = np.concatenate([fp4_inputs(rng, 256), rng.standard_normal((64, 256)) * rng.uniform(1e-3, 50, (64, 1))])
    x = x.astype(np.float32)
    f = formats.get("mxfp4")
    got = f.quantize(x)
    want = np.ascontiguousarray(quants.quantize(x, GT.MXFP4)).view(np.uint8).reshape(got.shape)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(f.dequantize(got), quants.dequantize(want, GT.MXFP4).reshape(x.shape))


E2M1x2 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


def nvfp4_scalar(x: np.ndarray) -> bytes:
    """ggml's quantize_row_nvfp4_ref transcribed per value: per 16 values, ue4m3(amax/6); each value
    the code nearest to it (strict <, so the lowest code on ties). The scale codec is gguf's."""
    from gguf.quants import NVFP4

    out = b""
    for blk in x.reshape(-1, 64):
        scales, qs = [], []
        for sub in blk.reshape(4, 16):
            amax = np.float32(0)
            for v in sub:
                amax = max(amax, abs(v))
            code = int(NVFP4.fp32_to_ue4m3(np.array([np.float32(amax) / np.float32(6.0)]))[0])
            d = float(NVFP4.ue4m3_to_fp32(np.array([code], np.uint8))[0])
            best = []
            for v in sub:
                bi, be = 0, abs(E2M1x2[0] * d - float(v))
                for i in range(1, 16):
                    err = abs(E2M1x2[i] * d - float(v))
                    if err < be:
                        bi, be = i, err
                best.append(bi)
            scales.append(code)
            qs += [best[j] | (best[j + 8] << 4) for j in range(8)]
        out += bytes(scales) + bytes(qs)
    return out


def test_nvfp4_bytes_match_ggml_scalar_and_gguf_dequantizer():
    rng = np.random.default_rng(2)
    x = np.concatenate([fp4_inputs(rng, 128), rng.standard_normal((6, 128)) * rng.uniform(1e-2, 50, (6, 1))])
    x = x.astype(np.float32)
    f = formats.get("nvfp4")
    got = f.quantize(x)
    assert got.tobytes() == nvfp4_scalar(x)
    np.testing.assert_array_equal(f.dequantize(got), quants.dequantize(got, GT.NVFP4).reshape(x.shape))
    assert (f.block_len, f.block_bytes, f.bits_per_element) == (64, 36, 4.5)


def test_kivi4_rows_are_q4_1():
    x = np.random.default_rng(3).standard_normal((16, 128)).astype(np.float32)
    got = formats.get("kivi4").quantize(x)
    want = np.ascontiguousarray(quants.quantize(x, GT.Q4_1)).view(np.uint8).reshape(got.shape)
    np.testing.assert_array_equal(got, want)


def _asym_codes(x: np.ndarray, bits: int) -> tuple[float, float, list[int]]:
    """ggml q4_1's rule per value, any width: d = (max-min)/top, q = trunc((x-min)/d + 0.5)."""
    f32 = np.float32
    lo, hi = f32(np.inf), f32(-np.inf)
    for v in x:
        lo, hi = min(lo, v), max(hi, v)
    top = (1 << bits) - 1
    d = f32((hi - lo) / f32(top))
    idv = f32(1) / d if d else f32(0)
    return d, lo, [min(top, int(f32((v - lo) * idv) + f32(0.5))) for v in x]


def _pack_scalar(q: list[int], bits: int) -> bytes:
    per, out = 8 // bits, b""
    for g in range(0, len(q), 32):
        grp, step = q[g : g + 32], 32 // per
        out += bytes(sum(grp[j + step * i] << (bits * i) for i in range(per)) for j in range(step))
    return out


def test_kivi2_rows_match_scalar_loop():
    x = np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32)
    got = formats.get("kivi2").quantize(x)
    for row, b in zip(x, got):
        want = b""
        for g in range(0, 64, 32):
            d, lo, q = _asym_codes(row[g : g + 32], 2)
            want += np.float16(d).tobytes() + np.float16(lo).tobytes() + _pack_scalar(q, 2)
        assert b.tobytes() == want
    assert formats.get("kivi2").bits_per_element == 3.0


@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
@pytest.mark.parametrize("bs", [16, 32])
def test_kivi_k_page_matches_scalar_loop(name, bs):
    bits = 4 if name == "kivi4" else 2
    codec = formats.get(name).k_page
    rng = np.random.default_rng(5)
    pages = rng.standard_normal((3, bs, 64)).astype(np.float32)
    pages[:, :, 5] *= 20  # an outlier channel: per-channel scales absorb it
    got = codec.quantize_page(pages)
    assert got.shape == (3, bs * codec.row_bytes(64, bs))
    for page, b in zip(pages, got):
        per_channel = [_asym_codes(page[:, c], bits) for c in range(64)]
        rows = b"".join(_pack_scalar([per_channel[c][2][t] for c in range(64)], bits) for t in range(bs))
        ds = b"".join(np.float16(d).tobytes() for d, _, _ in per_channel)
        ms = b"".join(np.float16(m).tobytes() for _, m, _ in per_channel)
        assert b.tobytes() == rows + ds + ms
    back = codec.dequantize_page(got, bs)
    step = np.ptp(pages, axis=1, keepdims=True) / ((1 << bits) - 1)
    assert np.all(np.abs(back - pages) <= step * 0.51 + 1e-2 * step.max())
    assert codec.bits_per_element(bs) == bits + 32 / bs


def test_kivi_k_needs_whole_pages_in_spec():
    with pytest.raises(kvhal.SpecError, match="block_size"):
        kvhal.CacheSpec(1, 1, 32, k_format="kivi4", v_format="kivi4", block_size=256)
    spec = kvhal.CacheSpec(1, 2, 128, k_format="kivi4", v_format="kivi2", block_size=16)
    assert spec.k_row_bytes == 64 + 32 and spec.v_row_bytes == 48
    assert spec.k_bits_per_element == 6.0
    # the page codec's own sizes take ints >= 1 (a numpy int too), as CacheSpec does
    codec = formats.get("kivi4").k_page
    assert codec.row_bytes(np.int64(128), np.int32(16)) == 64 + 32
    for n, bs in (("128", 16), (128.0, 16), (128, 0), (True, 16), (128, None)):
        with pytest.raises(kvhal.FormatError):
            codec.row_bytes(n, bs)  # type: ignore[arg-type]
    for bs in (0, -16, 16.0, False):
        with pytest.raises(kvhal.FormatError, match="block_size"):
            codec.bits_per_element(bs)  # type: ignore[arg-type]


def test_registry_ids_are_stable():
    # formats only join at the end: kernels and files on disk hold these ids
    assert formats.names()[:14] == [
        "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1",
        "fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4", "kivi4", "kivi2",
    ]  # fmt: skip
