"""ggml formats against the gguf package's quantizers (the independent oracle), byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants

import kvhal
from kvhal import formats

# the ggml formats gguf.quants can quantize (it only dequantizes nvfp4: tests/unit/test_formats_v2.py)
GGML = [f for f in formats.names() if formats.get(f).ggml_type and f != "nvfp4"]
BITS = {
    "f32": 32,
    "f16": 16,
    "bf16": 16,
    "q8_0": 8.5,
    "q4_0": 4.5,
    "q4_1": 5.0,
    "q5_0": 5.5,
    "q5_1": 6.0,
    "mxfp4": 4.25,
}


def oracle_bytes(x: np.ndarray, name: str) -> np.ndarray:
    return np.ascontiguousarray(quants.quantize(x, GT[formats.get(name).ggml_type])).view(np.uint8)


def oracle_values(q: np.ndarray, name: str, n: int) -> np.ndarray:
    t = GT[formats.get(name).ggml_type]
    raw = q.view(np.float32 if name == "f32" else np.float16) if name in ("f32", "f16") else q
    return quants.dequantize(raw, t).astype(np.float32).reshape(-1, n)


def adversarial(rng: np.random.Generator) -> np.ndarray:
    rows = [
        rng.standard_normal(256),
        np.zeros(256),  # all-zero blocks
        np.r_[rng.standard_normal(31) * 1e-3, 500.0, rng.standard_normal(224)],  # one huge outlier
        np.r_[-np.full(32, 7.0), np.full(32, 7.0), rng.standard_normal(192)],  # constant blocks of both signs
        np.tile(np.r_[1.0, -1.0], 128),  # ties: +max and -max in every block (first occurrence wins)
        np.tile(np.arange(32) - 15.5, 8) / 4,  # exact grid points and half-steps
        np.tile(
            np.r_[127.0, np.float32(0.49999997), -np.float32(0.49999997), 1.5, -2.5, np.zeros(27)], 8
        ),  # roundf edges
        rng.uniform(-65000, 65000, 256),  # near the fp16 limit
        np.r_[np.full(32, 1e-40), rng.standard_normal(224) * 1e-20],  # subnormal f32, tiny scales
        rng.uniform(0.5, 1.0, 256),  # all positive (min/max formats)
    ]
    return np.asarray(rows, np.float32)


@pytest.mark.parametrize("name", GGML)
def test_bytes_match_gguf_random(name):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 256)) * rng.uniform(0.01, 30, (64, 1))).astype(np.float32)
    got = formats.get(name).quantize(x)
    np.testing.assert_array_equal(got, oracle_bytes(x, name).reshape(got.shape))
    np.testing.assert_array_equal(formats.get(name).dequantize(got), oracle_values(got, name, 256))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf casting inf on the subnormal row
@pytest.mark.parametrize("name", GGML)
def test_bytes_match_gguf_adversarial(name):
    x = adversarial(np.random.default_rng(1))
    f = formats.get(name)
    got = f.quantize(x)
    want = oracle_bytes(x, name).reshape(got.shape)
    # the subnormal row: ggml/gguf take 1/d = inf there and cast inf to an integer (undefined in C);
    # kvhal takes 0. The fp16 scale is 0 either way, so compare values there, bytes everywhere else.
    subnormal = 8
    rows = [i for i in range(len(x)) if i != subnormal or f.block_len == 1]
    np.testing.assert_array_equal(got[rows], want[rows])
    deq = f.dequantize(got)
    np.testing.assert_array_equal(deq[rows], oracle_values(want, name, 256)[rows])
    if f.block_len > 1:
        assert np.all(deq[subnormal, :32] == 0)


@pytest.mark.parametrize("name", GGML)
def test_bits_per_element(name):
    f = formats.get(name)
    assert f.bits_per_element == BITS[name]
    assert f.row_bytes(128) * 8 == 128 * BITS[name]
    # the gguf package's own block table agrees
    from gguf.constants import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[GT[f.ggml_type]]
    assert (f.block_len, f.block_bytes) == (block, nbytes)


@pytest.mark.parametrize("name", GGML)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected(name, bad):
    x = np.ones((2, 64), np.float32)
    x[1, 40] = bad
    with pytest.raises(kvhal.NonFiniteError, match="non-finite"):
        formats.get(name).quantize(x)


@pytest.mark.parametrize("name", ["f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_values_beyond_fp16_rejected(name):
    x = np.ones((1, 32), np.float32)
    x[0, 0] = 70000.0
    with pytest.raises(kvhal.NonFiniteError, match="exceeds"):
        formats.get(name).quantize(x)


def test_error_cases():
    with pytest.raises(kvhal.FormatError, match="known formats"):
        formats.get("q3_7")
    with pytest.raises(kvhal.FormatError, match="name such as"):
        formats.get(["q8_0"])  # type: ignore[arg-type]
    with pytest.raises(kvhal.FormatError, match="multiple"):
        formats.get("q8_0").quantize(np.ones((1, 40), np.float32))
    with pytest.raises(kvhal.FormatError, match="whole number"):
        formats.get("q8_0").dequantize(np.zeros((1, 35), np.uint8))
    # not arrays of numbers, not ints: typed errors, not ValueError/TypeError from numpy
    with pytest.raises(kvhal.DTypeError, match="quantize takes float rows"):
        formats.get("q8_0").quantize("abc")  # type: ignore[arg-type]
    for text_or_flags in (["1.5"] * 32, [True] * 32):  # numpy would read both as values
        with pytest.raises(kvhal.DTypeError, match="quantize takes float rows"):
            formats.get("q8_0").quantize(text_or_flags)  # type: ignore[arg-type]
    assert formats.get("q8_0").quantize([[1.0] * 32]).shape == (1, 34)  # lists of numbers are arrays
    # ml_dtypes' bfloat16 (what load(dtype="bfloat16") returns; numpy's kind "V") holds floats
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.linspace(-2, 2, 64, dtype=np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(formats.get("q8_0").quantize(x), formats.get("q8_0").quantize(x.astype(np.float32)))
    # arrays as lists: text, flags and complex values are not values to quantize
    for not_floats in (np.array(["1.5"] * 32), np.ones(32, bool), np.ones(32, complex), np.ones(32, object)):
        with pytest.raises(kvhal.DTypeError, match="quantize takes float rows"):
            formats.get("q8_0").quantize(not_floats)
    # bytes are ints in [0, 255]: no cast of floats (1.5 -> 1) or wrap of other ints (-1 -> 255, 300 -> 44)
    for not_bytes in (np.full(34, 1.5), np.full(34, -1), np.full(34, 300), np.ones(34, bool), [1.5] * 34):
        with pytest.raises(kvhal.DTypeError, match="dequantize takes uint8 rows"):
            formats.get("q8_0").dequantize(not_bytes)  # type: ignore[arg-type]
    np.testing.assert_array_equal(
        formats.get("q8_0").dequantize(np.arange(34, dtype=np.int64)),
        formats.get("q8_0").dequantize(np.arange(34, dtype=np.uint8)),
    )
    with pytest.raises(kvhal.DTypeError, match="dequantize takes uint8 rows"):
        formats.get("q8_0").dequantize(None)  # type: ignore[arg-type]
    with pytest.raises(kvhal.FormatError, match="row length is an int"):
        formats.get("q8_0").row_bytes("32")  # type: ignore[arg-type]
    assert formats.get("q8_0").row_bytes(np.int64(64)) == 68


def test_quantization_error_bounds():
    """Each format's worst error stays within one quantization step (half a step for round-to-nearest)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((512, 128)).astype(np.float32)
    blocks = x.reshape(-1, 32)
    amax, span = np.abs(blocks).max(axis=1), np.ptp(blocks, axis=1)
    # step per block; the symmetric 4/5-bit formats clip +max's mirror image, so allow a full step there
    bound = {
        "f16": amax * 2.0**-11,
        "bf16": amax * 2.0**-8,
        "q8_0": amax / 127 * 0.6,
        "q4_0": amax / 8 * 1.01,
        "q5_0": amax / 16 * 1.01,
        "q4_1": span / 15 * 0.6,
        "q5_1": span / 31 * 0.6,
    }
    for name, b in bound.items():
        f = formats.get(name)
        err = np.abs(f.dequantize(f.quantize(x)) - x).reshape(-1, 32).max(axis=1)
        assert (err <= b + 1e-7).all(), name


def _ggml_scalar(x: np.ndarray, name: str) -> bytes:
    """A literal transcription of ggml-quants.c's scalar reference loops for one block (an oracle
    independent of both kvhal's vectorized code and gguf's), for the cases where they could differ."""
    f32, f16 = np.float32, np.float16
    out = b""
    if name in ("q4_0", "q5_0"):
        amax, mx = f32(0), f32(0)
        for v in x:
            if amax < abs(v):
                amax, mx = abs(v), v
        d = f32(mx / f32(-8 if name == "q4_0" else -16))
        idv = f32(1) / d if d else f32(0)
        bias, top = (f32(8.5), 15) if name == "q4_0" else (f32(16.5), 31)
        q = [min(top, int(f32(v * idv) + bias)) for v in x]
    else:  # q4_1, q5_1
        lo, hi = f32(np.finfo(f32).max), f32(-np.finfo(f32).max)
        for v in x:
            if v < lo:
                lo = v
            if v > hi:
                hi = v
        d = f32((hi - lo) / f32(15 if name == "q4_1" else 31))
        idv = f32(1) / d if d else f32(0)
        top = 15 if name == "q4_1" else 31
        q = [min(top, int(f32((v - lo) * idv) + f32(0.5))) for v in x]
    out += f16(d).tobytes()
    if name in ("q4_1", "q5_1"):
        out += f16(lo).tobytes()
    if name in ("q5_0", "q5_1"):
        qh = sum(((qi >> 4) & 1) << j for j, qi in enumerate(q))
        out += int(qh).to_bytes(4, "little")
    out += bytes((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4) for j in range(16))
    return out


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q5_1"])
def test_signed_zeros_and_ties_follow_ggml_c(name):
    rng = np.random.default_rng(3)
    cases = [
        np.r_[np.float32(-0.0), np.zeros(31)],  # all zero, first one negative
        np.r_[np.zeros(31), np.float32(-0.0)],
        np.full(32, -0.0),
        np.r_[-0.0, 0.0, rng.uniform(0.1, 1, 30)],  # zero min: first occurrence decides its sign
        np.r_[rng.uniform(-1, -0.1, 30), 0.0, -0.0],  # zero max
        np.r_[2.0, -2.0, rng.uniform(-1, 1, 30)],  # |max| tie: the first wins
        np.r_[-2.0, 2.0, rng.uniform(-1, 1, 30)],
    ]
    f = formats.get(name)
    for x in cases:
        x = np.asarray(x, np.float32)
        assert f.quantize(x[None]).tobytes() == _ggml_scalar(x, name), x[:4]


def test_round_f16_is_numpys_float16_round_trip_bit_for_bit():
    """The tail path's f16 rounding (vectorized integer steps) against numpy's own cast, over a sweep of
    f32 bit patterns in f16's range and the edge cases: ties to even, subnormals, -0.0, the largest f16."""
    from kvhal.formats.ggml import F16_MAX, round_f16

    rng = np.random.default_rng(3)
    x = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) <= F16_MAX)]
    ties = np.float32(1.0) + np.arange(8, dtype=np.float32) * np.float32(2.0**-11)  # halfway between f16s
    edge = [0.0, -0.0, F16_MAX, -F16_MAX, 65519.0, 2.0**-14, -(2.0**-14), 2.0**-24, 2.0**-25, 3 * 2.0**-25, 1e-45]
    for a in (x, ties, -ties, np.array(edge, np.float32), rng.standard_normal((5, 3, 64), dtype=np.float32) * 1e-5):
        got = round_f16(a)
        assert got.shape == a.shape and got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), a.astype(np.float16).astype(np.float32).view(np.uint32))
